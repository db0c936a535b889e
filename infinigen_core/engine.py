"""The engine: an unmodified transformers model whose attention reads from our KV pool.

One forward step, in order:
  1. the pool reserves slots for the new tokens (evicting now, if limited);
  2. the model runs its own forward; before each attention module a pre-hook hands that layer's input
     to the policy, which may speculate which slots a later layer needs and start fetching them;
  3. our registered attention function writes the layer's new K/V to the pool, then attends densely
     (prefill, dense layers, dense policies) or over the fetched rows plus the new token;
  4. per-layer statistics of the step are kept for the UI and the benchmarks.
Masks come from the pool's positions, not from transformers, so the mask registration returns None.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .arch import ModelAdapter
from .config import ConfigError, EngineConfig
from .fetch import PendingFetch, make_fetcher
from .kv_pool import KVPool, release_pinned_memory
from .policies import POLICIES, PolicyContext, Selection
from .prefix import common_prefix_length
from .stats import DeferredValues, LayerStats, StepStats

ATTENTION_NAME = "infinigen"
KEEP_SELECTIONS_STEPS = 16  # decode steps whose selected positions stay inspectable (they stay on the device)


class ContextOverflowError(ValueError):
    """The conversation would not fit in the model's context window."""


@dataclass
class _Step:
    engine: "InfiniGenEngine"
    first_position: int
    new_tokens: int
    slots: list[torch.Tensor]  # per layer, the pool slots of the new tokens (on the pool's device)
    device_slots: list[torch.Tensor]  # the same on the compute device (one copy per step without eviction)
    query_positions: torch.Tensor  # on the compute device
    stats: StepStats
    prefetched: dict[int, tuple[PendingFetch, Selection | None]] = field(default_factory=dict)
    device_values: list[tuple[LayerStats, torch.Tensor]] = field(default_factory=list)  # sent to the host once

    @property
    def is_decode(self) -> bool:
        return self.new_tokens == 1

    @property
    def past_len(self) -> int:
        """Tokens every layer held before this step (the same in every layer)."""
        return self.engine.pool.size() - self.new_tokens


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [heads, n, dim] over keys/values [kv_heads, S, dim]; returns (out [heads, n, dim], probs [kv, group, n, S]).

    `softcap` (Gemma 2) bounds the logits to (-softcap, softcap) through tanh, as the family's attention does.
    """
    kv_heads, n, dim = keys.shape[0], query.shape[1], query.shape[-1]
    # Fold each KV head's query group into rows of one batched product: keys are read in place, never
    # expanded per query head (a broadcast matmul would materialise a copy of them for every head).
    grouped = query.reshape(kv_heads, -1, dim)  # [kv, group*n, dim]
    logits = torch.bmm(grouped, keys.transpose(1, 2)).float().mul_(scale).view(kv_heads, -1, n, keys.shape[1])
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.to(values.dtype).view(kv_heads, -1, keys.shape[1]), values).reshape(query.shape)
    return out, probs


def _attention_entry(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.pop("infinigen_step", None)
    if step is None:  # the model used outside the engine: plain causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return step.engine._attend(module.layer_idx, query, key, value, scaling, step)


def _masks_come_from_the_pool(*args, **kwargs):
    return None


AttentionInterface.register(ATTENTION_NAME, _attention_entry)
AttentionMaskInterface.register(ATTENTION_NAME, _masks_come_from_the_pool)


class InfiniGenEngine:
    """Holds one conversation's KV cache for one model and runs forward steps over it.

    >>> engine.prefill(tokenizer("Hello")["input_ids"])      # doctest: +SKIP
    >>> logits = engine.decode(next_token_id)                # doctest: +SKIP
    """

    def __init__(self, model, tokenizer, config: EngineConfig, *, skew_set=None, device: str | torch.device = "cpu",
                 fingerprint: str = "unknown") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter.for_model(model)
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            self.dtype = torch.float16
        self.skew_set = skew_set
        self.fingerprint = fingerprint
        self.legacy_fingerprints: tuple[str, ...] = ()  # what earlier versions called this model (loading.py)
        self.token_ids: list[int] = []
        self.history: deque[StepStats] = deque(maxlen=config.history_steps)
        self.steps_run = 0
        self._attention_modules = self.adapter.attention_modules(model)
        model.set_attn_implementation(ATTENTION_NAME)
        self._hooks = [
            module.register_forward_pre_hook(self._before_attention, with_kwargs=True)
            for module in self._attention_modules
        ]
        self.pool: KVPool | None = None
        self.fetcher = None
        self._ones: torch.Tensor | None = None
        self.configure(config)

    # ------------------------------------------------------------------ settings
    @torch.inference_mode()
    def configure(self, config: EngineConfig) -> None:
        """Apply new settings; the conversation's cache is kept (and moved or trimmed if needed).

        The pool itself is kept when its device and limits stay the same (no copy, no new pinned memory).
        """
        policy_class = POLICIES[config.policy]
        if policy_class.needs_skew and self.skew_set is None:
            raise ConfigError(f"the {config.policy} policy needs the model's skew matrices: calibrate it first")
        layout = dict(
            device=self.device if policy_class.keeps_pool_on_device else torch.device("cpu"),
            pin_memory=self.device.type == "cuda" and not policy_class.keeps_pool_on_device,
            limit_tokens=config.pool_limit_tokens,
            sink_tokens=config.sink_tokens,
            recent_window=config.recent_window,
        )
        old_pool = self.pool
        if self.fetcher is not None:
            self.fetcher.flush()  # every pending write lands in the old pool first
        if old_pool is None or not old_pool.same_layout(**layout):
            self.pool = KVPool(
                num_layers=self.adapter.num_layers,
                num_kv_heads=self.adapter.num_kv_heads,
                head_dim=self.adapter.head_dim,
                dtype=self.dtype,
                **layout,
            )
            if old_pool is not None:
                self.pool.copy_from(old_pool)
                release_pinned_memory(old_pool)
        self.config = config
        self.history = deque(self.history, maxlen=config.history_steps)
        context = PolicyContext(self.pool, config, self.adapter, self._attention_modules, self.device, self.skew_set)
        self.policy = policy_class(context)
        if self.fetcher is not None:
            self.fetcher.close()
        self.fetcher = make_fetcher(self.pool, self.device, max_rows=config.budget_tokens_for(self.max_context) + 1)

    def prepare(self, new_tokens: int) -> None:
        """Make room now for `new_tokens` more tokens, so no step of the coming reply allocates pool memory."""
        self.pool.ensure_capacity(min(self.pool.total_tokens + new_tokens, self.max_context))
        self.policy.ensure_capacity(self.pool.capacity)

    def close(self) -> None:
        """Detach from the model (its hooks) and stop the fetch worker; the engine is unusable after."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.fetcher.close()
        release_pinned_memory(self.pool)

    # ------------------------------------------------------------------ conversation
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_context(self) -> int:
        return self.adapter.max_context

    @torch.inference_mode()
    def prefill(self, token_ids: Iterable[int], progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Append tokens in chunks of `prefill_chunk`; returns the logits [vocab] after the last one."""
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        self._check_fits(len(token_ids))
        logits = None
        for start in range(0, len(token_ids), self.config.prefill_chunk):
            logits = self._forward(token_ids[start : start + self.config.prefill_chunk])[-1]
            if progress is not None:
                progress(min(start + self.config.prefill_chunk, len(token_ids)), len(token_ids))
        return logits

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token; returns the logits [vocab] for the next."""
        self._check_fits(1)
        return self._forward([token_id])[-1]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens one decode step at a time; returns logits [n, vocab] (the same path chat uses)."""
        return torch.stack([self.decode(token) for token in token_ids])

    @torch.inference_mode()
    def truncate(self, n_tokens: int) -> None:
        """Keep the first n_tokens of the conversation (edit, regenerate)."""
        self.fetcher.flush()
        moved = self.pool.truncate(n_tokens)
        del self.token_ids[n_tokens:]
        if moved:  # eviction had reordered the slots: per-slot state follows the compacted pool
            self.policy.rebuild()

    @torch.inference_mode()
    def reset(self) -> None:
        self.truncate(0)
        self.history.clear()

    @torch.inference_mode()
    def sync_to(self, token_ids: list[int], progress: Callable[[int, int], None] | None = None) -> torch.Tensor | None:
        """Make the cache hold exactly `token_ids`, reusing the longest common prefix; logits after the last.

        Returns None when nothing new had to be run (the cache already held them all).
        """
        common = common_prefix_length(self.token_ids, token_ids)
        if common < len(self.token_ids):
            self.truncate(common)
        if common == len(token_ids):
            return None
        return self.prefill(token_ids[common:], progress)

    def recent_decode_steps(self) -> list[StepStats]:
        """The recent decode steps that ran layers, oldest first: a copy, safe to read from another thread
        while this engine keeps decoding (the UI's panels and inspector do)."""
        return [step for step in list(self.history) if step.is_decode and step.layers]

    def _check_fits(self, n_new: int) -> None:
        if self.pool.total_tokens + n_new > self.max_context:
            raise ContextOverflowError(
                f"{self.pool.total_tokens + n_new} tokens would exceed the model's context window of "
                f"{self.max_context}: start a new session or drop the oldest turns"
            )

    # ------------------------------------------------------------------ restore / export (sessions)
    @torch.inference_mode()
    def export_rows(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """K/V rows of positions [start, end) per layer, plus their token ids, as CPU tensors."""
        self.fetcher.flush()
        tensors = {"token_ids": torch.tensor(self.token_ids[start:end], dtype=torch.int64)}
        for layer in range(self.adapter.num_layers):
            positions = self.pool.positions(layer)
            rows = ((positions >= start) & (positions < end)).nonzero().squeeze(1)
            rows = rows[torch.argsort(positions[rows])]
            tensors[f"k.{layer}"] = self.pool.keys(layer)[:, rows].cpu().contiguous()
            tensors[f"v.{layer}"] = self.pool.values(layer)[:, rows].cpu().contiguous()
            tensors[f"pos.{layer}"] = positions[rows].cpu().contiguous()
        return tensors

    @torch.inference_mode()
    def import_rows(self, chunks: Iterable[dict[str, torch.Tensor]]) -> int:
        """Restore exported chunks (in order) after the current tokens, rebuilding partial keys; no model run.

        A chunk's K/V are in any dtype, or int8 codes with `k_scale.L` / `v_scale.L` [kv_heads, rows] beside
        them (row = codes * scale) and perhaps `k_channel_scale.L` [kv_heads, dim] (each key channel times
        its scale); either way they are written straight into the pool's slots.
        """
        self.fetcher.flush()
        restored = 0
        for chunk in chunks:
            ids = chunk["token_ids"].tolist()
            start = len(self.token_ids)
            for layer in range(self.adapter.num_layers):
                positions = chunk[f"pos.{layer}"]
                if positions.numel() and int(positions.min()) < start:
                    raise ValueError("chunk positions overlap the tokens already cached")
                # int8 chunks carry per-row scales; the pool widens the codes as it copies them in
                self.pool.append_rows(layer, chunk[f"k.{layer}"], chunk[f"v.{layer}"], positions,
                                      chunk.get(f"k_scale.{layer}"), chunk.get(f"v_scale.{layer}"),
                                      chunk.get(f"k_channel_scale.{layer}"))
            self.token_ids.extend(ids)
            self.pool.set_total_tokens(len(self.token_ids))
            restored += len(ids)
        self.policy.rebuild()
        return restored

    def legacy_kv_signatures(self) -> list[dict[str, str]]:
        """The signatures earlier versions wrote for this very pool (the model under an older fingerprint)."""
        return [{**self.kv_signature(), "model_fingerprint": old} for old in self.legacy_fingerprints]

    def kv_signature(self) -> dict[str, str]:
        """What a saved pool must match to be reused."""
        skew = self.skew_set.fingerprint() if self.skew_set is not None else "none"
        return {
            "model_fingerprint": self.fingerprint,
            "dtype": str(self.dtype).replace("torch.", ""),
            "num_layers": str(self.adapter.num_layers),
            "num_kv_heads": str(self.adapter.num_kv_heads),
            "head_dim": str(self.adapter.head_dim),
            "skew": skew,
        }

    # ------------------------------------------------------------------ one forward step
    @torch.inference_mode()
    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        n, first = len(token_ids), self.pool.total_tokens
        if n > 1:
            self.fetcher.flush()  # prefill reads the pool from this thread: pending writes land first
        stats = StepStats(step=self.steps_run, position=first, new_tokens=n)
        slots = self.pool.reserve(n)
        step = _Step(
            engine=self,
            first_position=first,
            new_tokens=n,
            slots=slots,
            device_slots=self._slots_on_device(slots),
            query_positions=torch.arange(first, first + n, device=self.device),
            stats=stats,
        )
        self.policy.ensure_capacity(self.pool.capacity)
        if step.is_decode and not self.policy.keeps_pool_on_device:
            step.prefetched[0] = self._start_fetch(0, step)  # later layers are started one layer ahead
        started = time.perf_counter()
        try:
            output = self.model(
                input_ids=self._to_device(torch.tensor([token_ids])),
                position_ids=step.query_positions.unsqueeze(0),
                # our mask function returns None; passing a mask only spares transformers a look at the
                # position ids (a host read) for packed sequences
                attention_mask=self._all_ones(n),
                use_cache=False,
                logits_to_keep=1,
                infinigen_step=step,
            )
        except BaseException:
            self.policy.finish_step(completed=False)
            if self.pool.truncate(first):
                self.policy.rebuild()
            raise
        self.policy.finish_step(completed=True)
        self.token_ids.extend(token_ids)
        self.steps_run += 1
        stats.total_ms = (time.perf_counter() - started) * 1e3
        stats.pool_bytes = self.pool.bytes_allocated()
        stats.device_bytes = self.device_bytes()
        self._send_device_values_to_host(step)
        if len(self.history) > KEEP_SELECTIONS_STEPS:
            self.history[-KEEP_SELECTIONS_STEPS].drop_selections()
        self.history.append(stats)
        return output.logits[0].float()

    def _slots_on_device(self, slots: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.pool.device == self.device:
            return slots
        if self.pool.last_reserved_contiguous:  # every layer shares one tensor: one copy
            return [self._to_device(slots[0])] * len(slots)
        return [self._to_device(layer_slots) for layer_slots in slots]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor to the compute device without waiting (pinned, non-blocking) on a GPU."""
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _all_ones(self, n: int) -> torch.Tensor:
        if self._ones is None or self._ones.shape[1] < n:
            self._ones = torch.ones(1, max(n, self.config.prefill_chunk), dtype=torch.long, device=self.device)
        return self._ones[:, :n]

    def _send_device_values_to_host(self, step: "_Step") -> None:
        """One stacked, non-blocking copy per step of what the layers left on the device (alpha counts)."""
        if not step.device_values:
            return
        values = torch.stack([value for _, value in step.device_values]).double()
        host, ready = self.fetcher.host.to_host(values)
        heads = self.adapter.num_heads
        step.stats.deferred = DeferredValues(host, ready, [(layer, heads) for layer, _ in step.device_values])

    def device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        partial = self.policy.device_bytes()
        on_device = self.pool.bytes_allocated() if self.policy.keeps_pool_on_device else 0
        return partial + on_device

    def _before_attention(self, module, args, kwargs):
        step = kwargs.get("infinigen_step")
        # Several engines may wrap one model (tests, the eval tools); each handles only its own steps.
        if step is None or step.engine is not self or not step.is_decode:
            return None
        target = module.layer_idx + 1
        if target >= self.adapter.num_layers:
            return None
        if self.policy.is_sparse(target):
            new_slots = None if self.pool.last_reserved_contiguous else step.device_slots[target]
            selection = self.policy.speculate(module.layer_idx, kwargs["hidden_states"], kwargs.get("position_embeddings"),
                                              step.query_positions, step.past_len, new_slots)
            if selection is not None:
                step.prefetched[target] = (self.fetcher.start_rows(target, selection.slots), selection)
        elif not self.policy.keeps_pool_on_device:
            step.prefetched[target] = self._start_fetch(target, step)
        return None

    def _start_fetch(self, layer: int, step: "_Step") -> tuple[PendingFetch, Selection | None]:
        """Start the fetch of a layer that nothing speculated for: its selected rows, or all of it."""
        if self.policy.is_sparse(layer):
            selection = self.policy.select(layer, step.past_len, step.first_position)
            if selection is not None:
                return self.fetcher.start_rows(layer, selection.slots), selection
        return self.fetcher.start_layer(layer), None

    def _attend(self, layer: int, query, key, value, scaling: float, step: _Step):
        started = time.perf_counter()
        new_keys, new_values = key[0], value[0]  # [kv_heads, n, dim]
        self.fetcher.write(layer, step.slots[layer], new_keys, new_values)
        slots = step.device_slots[layer]
        self.policy.on_write(layer, slots, new_keys)
        stats = LayerStats(layer=layer, context_len=step.past_len, fetched=step.past_len, sparse=False)
        if not step.is_decode:
            out = self._attend_prefill(layer, query, new_keys, new_values, scaling, step, slots)
        else:
            pending, selection = step.prefetched.pop(layer, None) or self._start_fetch(layer, step)
            fetched = pending.wait(new_keys, new_values, slots)
            stats.fetch_wait_ms = fetched.wait_ms
            valid, selected = (None, None) if selection is None else (selection.valid, selection.slots)
            out = self._attend_decode(layer, query, fetched.keys, fetched.values, scaling, valid, slots, selected)
            if selection is not None:
                self._record_selection(layer, query, key, scaling, selection, stats, step)
        stats.compute_ms = (time.perf_counter() - started) * 1e3 - stats.fetch_wait_ms
        step.stats.layers.append(stats)
        return out, None

    def _attend_prefill(self, layer, query, new_keys, new_values, scaling, step, new_slots) -> torch.Tensor:
        """Several new tokens (prefill): causal attention over the pool, masked by positions."""
        keys, values = self.pool.keys(layer), self.pool.values(layer)
        if keys.device != self.device:  # the new rows are still on their way to the pool: use the device's
            keys, values = keys.to(self.device), values.to(self.device)
            keys.index_copy_(1, new_slots, new_keys)
            values.index_copy_(1, new_slots, new_values)
        positions = self.pool.positions(layer).to(self.device).unsqueeze(0)
        mask = positions <= step.query_positions.unsqueeze(1)  # [n, S]
        window = self.adapter.sliding_window(layer)
        if window is not None:  # a sliding layer sees its last `window` positions, itself included
            mask &= positions > step.query_positions.unsqueeze(1) - window
        softcap = self.adapter.softcap
        if self.policy.needs_attention_weights or softcap is not None:  # SDPA cannot soft-cap
            out, probs = grouped_attention(query[0], keys, values, scaling, mask, softcap)
            if self.policy.needs_attention_weights:
                self.policy.on_attention(layer, None, probs, new_slots)
        else:
            out = F.scaled_dot_product_attention(
                query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
            )[0]
        return out.transpose(0, 1).unsqueeze(0)  # [1, n, heads, dim]

    def _attend_decode(self, layer, query, keys, values, scaling, valid, new_slots, selected) -> torch.Tensor:
        """One new token over rows [kv_heads, S, dim] (the new token's included): [1, 1, heads, dim].

        Each KV head's query group rides as the query length of one batch entry, so grouped-query
        attention needs no copy of the keys per query head, and at one token no causal mask: `valid`
        (InfiniGen's alpha mask over ranked rows) is the only mask there is.
        """
        # keys/values: [kv, S, dim] (a pool view) or [kv, 1, S, dim] (a gather, already in SDPA's shape)
        kv_heads, dim = keys.shape[0], keys.shape[-1]
        window = self.adapter.sliding_window(layer)
        if window is not None and selected is None:  # a sliding layer reads its last `window` positions only
            if self.pool.slots_are_positions:
                keys, values = keys[..., -window:, :], values[..., -window:, :]  # slot i holds position i: a slice
            else:
                positions = self.pool.positions(layer).to(self.device).view(1, -1)
                valid = positions > self.pool.total_tokens - 1 - window
        softcap = self.adapter.softcap
        if self.policy.needs_attention_weights or softcap is not None:  # SDPA cannot soft-cap
            if keys.dim() == 4:
                keys, values = keys[:, 0], values[:, 0]
            mask = None if valid is None else valid.view(1, 1, 1, -1)
            out, probs = grouped_attention(query[0], keys, values, scaling, mask, softcap)
            if self.policy.needs_attention_weights:
                self.policy.on_attention(layer, selected, probs, new_slots)
        else:
            if keys.dim() == 3:
                keys, values = keys.unsqueeze(1), values.unsqueeze(1)
            grouped = query.view(kv_heads, 1, -1, dim)  # [kv, 1, group, dim]: a query group per KV head
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid, scale=scaling)
        return out.view(1, 1, -1, dim)

    def _record_selection(self, layer, query, key, scaling, selection, stats, step) -> None:
        """What a sparse layer fetched, for the panels and the inspector: no host read here."""
        stats.sparse = True
        stats.fetched = selection.slots.shape[1]
        stats.speculate_ms = selection.speculate_ms
        if self.pool.slots_are_positions:
            stats.selected_positions = selection.slots
        else:
            stats.selected_positions = self.pool.positions(layer)[selection.slots.to(self.pool.device)]
        stats.selected_scores = selection.scores
        if selection.alpha_total is not None:
            stats.deferred_from = step.stats
            step.device_values.append((stats, selection.alpha_total))
        if self.config.record_recall:
            self._measure_recall(layer, query, key, scaling, selection, stats)

    def _measure_recall(self, layer, query, key, scaling, selection, stats) -> None:
        """How much of the true (dense) attention mass the fetched rows carry; costs a dense pass."""
        past = self.pool.keys(layer).to(self.device)[:, : self.pool.size(layer)]
        is_past = self.pool.positions(layer).to(self.device) < stats_position(self.pool, layer)
        keys = past[:, is_past]
        slot_of_row = is_past.nonzero().squeeze(1)
        _, probs = grouped_attention(query[0], torch.cat([keys, key[0]], dim=1), torch.cat([keys, key[0]], dim=1), scaling,
                                     softcap=self.adapter.softcap)
        probs = probs[:, :, 0, :]  # [kv, group, rows+1]
        chosen = torch.zeros(probs.shape[0], probs.shape[-1], dtype=torch.bool, device=probs.device)
        row_index = torch.full((self.pool.size(layer),), -1, dtype=torch.long, device=probs.device)
        row_index[slot_of_row] = torch.arange(slot_of_row.numel(), device=probs.device)
        attended = selection.slots if selection.valid is None else selection.slots[:, selection.valid[0, 1:]]
        chosen.scatter_(1, row_index[attended.to(probs.device)], True)
        chosen[:, -1] = True  # the new token is always attended
        covered = (probs * chosen.unsqueeze(1)).sum(-1)
        stats.attention_recall = float(covered.mean())
        sorted_probs = probs.sort(dim=-1, descending=True).values.cumsum(-1)
        needed = (sorted_probs < 0.9).sum(-1).float() + 1
        stats.tokens_for_90 = int(needed.mean().round())
        # Kept for the prefetch inspector: the dense attention of this step, averaged over heads.
        stats.true_attention = probs[:, :, :-1].mean(dim=(0, 1)).cpu()
        stats.true_attention_positions = self.pool.positions(layer)[slot_of_row.to(self.pool.device)].cpu()


def stats_position(pool: KVPool, layer: int) -> int:
    """Position of the token being decoded (the newest in the pool)."""
    return int(pool.positions(layer).max())
