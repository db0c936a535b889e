"""What one forward step does in each layer: speculate for the next layer, write, fetch, attend, record.

The engine (engine.py) runs the model over a `Step`; the model's attention calls (through compiled.py's
opaque op) `LayerWork.attend` once per layer, which, in order:
  1. lets the policy speculate from this layer's input which slots the next layer needs and starts their
     fetch (or the next layer's whole fetch), so that it overlaps this layer's work; where the pool shares
     the compute device's memory there is no fetch to overlap, and a selecting layer chooses its own slots
     with its own query instead (`rehearses_ahead`);
  2. writes the layer's new K/V to the pool (through the fetcher: on a GPU a copy to host memory);
  3. attends densely (prefill, dense layers, dense policies) or over the fetched rows plus the new token;
  4. records the layer's statistics, without reading any device value on the host.
After the forward, `finish` sends what the layers left on the device to the host in one copy per step.
Where the pool and the compute share the CPU, a one-token step of the common policies runs these same
steps in C++ instead (decode_lane.py, `LayerWork.lane`); this module stays the reference it is tested against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .arch import ModelAdapter
from .attention import PoolAttention
from .config import EngineConfig
from .decode_lane import DecodeLane
from .fetch import DirectFetcher, PendingFetch
from .kv_pool import KVPool
from .policies import KVPolicy, Selection
from .stats import DeferredValues, LayerStats, StepStats


@dataclass
class Step:
    work: "LayerWork"
    first_position: int
    new_tokens: int
    slots: list[torch.Tensor]  # per layer, the pool slots of the new tokens (on the pool's device)
    device_slots: list[torch.Tensor]  # the same on the compute device (one copy per step without eviction)
    query_positions: torch.Tensor  # on the compute device
    stats: StepStats
    # why the sparse layers attend densely this step (None: they select): when the budget covers every token
    # held, a selection would fetch them all, so rehearsing which to fetch is pure cost
    dense_reason: str | None = None
    prefetched: dict[int, tuple[PendingFetch, Selection | None]] = field(default_factory=dict)
    device_values: list[tuple[LayerStats, torch.Tensor]] = field(default_factory=list)  # sent to the host once
    # after eviction, the slots each sparse layer selected, turned into positions once the step has run
    selected_slots: list[tuple[LayerStats, int, torch.Tensor]] = field(default_factory=list)
    lane: object | None = None  # decode_lane.DecodeLane: the step's attention runs in C++, layer after layer

    @property
    def is_decode(self) -> bool:
        return self.new_tokens == 1

    @property
    def past_len(self) -> int:
        """Tokens every layer held before this step (the same in every layer)."""
        return self.work.pool.size() - self.new_tokens

    def selects(self, layer: int) -> bool:
        """Whether `layer` attends over selected rows this step (a sparse layer not made dense by the budget)."""
        return self.dense_reason is None and self.work.policy.is_sparse(layer)


@dataclass(frozen=True)
class LayerWork:
    """One engine's per-layer work under its current settings (rebuilt by `configure`)."""

    pool: KVPool
    policy: KVPolicy
    fetcher: object  # fetch.DirectFetcher | fetch.StreamFetcher
    attention: PoolAttention
    adapter: ModelAdapter
    config: EngineConfig

    @cached_property
    def has_sparse_layers(self) -> bool:
        return any(self.policy.is_sparse(layer) for layer in range(self.adapter.num_layers))

    def budget_covers(self, past_len: int) -> bool:
        """A sparse policy's budget (its floor included) reaches every past token: selecting would keep all.
        With no past token at all (a first token decoded alone) there is nothing to select, whatever the config."""
        if not self.has_sparse_layers:
            return False
        if past_len == 0:
            return True
        return self.config.dense_under_budget and self.config.budget_tokens_for(past_len) >= past_len

    @cached_property
    def lane(self) -> DecodeLane | None:
        """Where one-token steps can run their attention in C++ from layer to layer (decode_lane.py)."""
        return DecodeLane.for_work(self)

    @cached_property
    def rehearses_ahead(self) -> bool:
        """Whether a selecting layer's rows are chosen one layer early, from the previous layer's input, so
        that their fetch across devices overlaps that layer's work (InfiniGen's pipeline). Where the pool
        shares the compute device's memory nothing crosses, so the early start would buy nothing and cost
        accuracy: each selecting layer then chooses with its own query. `EngineConfig.selects_ahead` overrides."""
        if self.config.selects_ahead is not None:
            return self.config.selects_ahead
        return not isinstance(self.fetcher, DirectFetcher)

    def attend(self, step: Step, layer: int, query, key, value, scaling: float, layer_input, position_embeddings):
        if step.is_decode and not self.rehearses_ahead:
            if step.selects(layer):
                self._select_from_query(layer, query, step)
        elif step.is_decode and layer_input is not None:
            self._speculate_next(layer, layer_input, position_embeddings, step)
        started = time.perf_counter()
        new_keys, new_values = key[0], value[0]  # [kv_heads, n, dim]
        slots = step.device_slots[layer]
        self.fetcher.write(layer, step.slots[layer], new_keys, new_values, slots)
        self.policy.on_write(layer, slots, new_keys)
        window = self.adapter.sliding_window(layer)
        read = step.past_len if window is None else min(step.past_len, window - 1)  # a window includes the new token
        stats = LayerStats(layer=layer, context_len=step.past_len, fetched=read, sparse=False, window=window)
        if step.dense_reason is not None and self.policy.is_sparse(layer):
            stats.dense_reason = step.dense_reason
        if not step.is_decode:
            out = self.attention.prefill(layer, query, new_keys, new_values, scaling, step.query_positions, slots)
        else:
            pending, selection = step.prefetched.pop(layer, None) or self.start_fetch(layer, step)
            fetched = pending.wait(new_keys, new_values, slots)
            stats.fetch_wait_ms = fetched.wait_ms
            valid, selected = (None, None) if selection is None else (selection.valid, selection.slots)
            out = self.attention.decode(layer, query, fetched.keys, fetched.values, scaling, valid, slots, selected,
                                        fetched.rows)
            if selection is not None:
                self._record_selection(layer, query, key, scaling, selection, stats, step)
        stats.compute_ms = (time.perf_counter() - started) * 1e3 - stats.fetch_wait_ms
        step.stats.layers.append(stats)
        return out

    def _speculate_next(self, layer: int, layer_input, position_embeddings, step: Step) -> None:
        """Before `layer` attends: start the next layer's fetch, of the slots the policy speculates it needs
        (from this layer's input) or of all its rows, so that the fetch overlaps this layer's work."""
        target = layer + 1
        if target >= self.adapter.num_layers:
            return
        if step.selects(target):
            new_slots = None if self.pool.last_reserved_contiguous else step.device_slots[target]
            selection = self.policy.speculate(layer, layer_input, position_embeddings, step.query_positions,
                                              step.past_len, new_slots)
            if selection is not None:
                step.prefetched[target] = self._start_rows(target, selection)
        elif not self.policy.keeps_pool_on_device:
            step.prefetched[target] = self.start_fetch(target, step)

    def _select_from_query(self, layer: int, query, step: Step) -> None:
        """A selecting layer's rows, chosen from its own query (where nothing is fetched ahead)."""
        new_slots = None if self.pool.last_reserved_contiguous else step.device_slots[layer]
        selection = self.policy.select_from_query(layer, query, step.past_len, new_slots)
        if selection is not None:
            step.prefetched[layer] = self._start_rows(layer, selection)

    def start_fetch(self, layer: int, step: Step) -> tuple[PendingFetch, Selection | None]:
        """Start the fetch of a layer that nothing speculated for: its selected rows, or all of it."""
        if step.selects(layer):
            selection = self.policy.select(layer, step.past_len, step.first_position)
            if selection is not None:
                return self._start_rows(layer, selection)
        return self.fetcher.start_layer(layer), None

    def _start_rows(self, layer: int, selection: Selection) -> tuple[PendingFetch, Selection]:
        return self.fetcher.start_rows(layer, selection.slots, selection.per_head), selection

    def _record_selection(self, layer, query, key, scaling, selection, stats, step) -> None:
        """What a sparse layer fetched, for the panels and the inspector: no host read here."""
        stats.sparse = True
        stats.fetched = selection.rows_per_head
        stats.speculate_ms = selection.speculate_ms
        if self.pool.slots_are_positions:
            stats.selected_positions = selection.slots
        else:  # the slot-to-position map lives on the host: looked up once the step has run, for all layers
            step.selected_slots.append((stats, layer, selection.slots))
        stats.selected_scores = selection.scores
        stats.selected_read = None if selection.valid is None else selection.valid[:, 1:]
        if selection.alpha_total is not None:
            stats.deferred_from = step.stats
            step.device_values.append((stats, selection.alpha_total))
        if self.config.record_recall:
            self.attention.measure_recall(layer, query, key, scaling, selection, stats)

    def finish(self, step: Step) -> None:
        """After the step's forward: the selected positions (after eviction), then one stacked,
        non-blocking copy to the host of what the layers left on the device (alpha counts)."""
        if step.selected_slots:  # before the next reserve, which may give those slots to new tokens
            # one copy for every layer; a layer's share of the budget sets its width (budget_shares.py)
            widths = [layer_slots.shape[1] for _, _, layer_slots in step.selected_slots]
            slots = torch.cat([layer_slots for _, _, layer_slots in step.selected_slots], dim=1).to(self.pool.device)
            for (stats, layer, _), layer_slots in zip(step.selected_slots, slots.split(widths, dim=1)):
                stats.selected_positions = self.pool.positions(layer)[layer_slots]
        if step.device_values:
            values = torch.stack([value for _, value in step.device_values]).double()
            host, ready = self.fetcher.host.to_host(values)
            heads = self.adapter.num_heads
            step.stats.deferred = DeferredValues(host, ready, [(layer, heads) for layer, _ in step.device_values])
