"""The engine: an unmodified transformers model whose attention reads from our KV pool.

One forward step, in order:
  1. the pool reserves slots for the new tokens (evicting now, if limited);
  2. the model runs its own forward (at one token, `decode_step`: compiled where compiled.py could, else
     eager; prefill always eager); a pre-hook passes each attention module's input on to our attention;
  3. our registered attention function (`_attend`, one opaque op inside a compiled step) first lets the
     policy speculate from that input which slots the next layer needs and start fetching them, then
     writes the layer's new K/V to the pool and attends densely (prefill, dense layers, dense policies) or
     over the fetched rows plus the new token;
  4. per-layer statistics of the step are kept for the UI and the benchmarks.
Masks come from the pool's positions, not from transformers, so the mask registration returns None.
The attention maths of step 3 lives in attention.py; a saved session's rows are exported and imported by
rows.py; the engine attaches to the model, runs the step in this order and keeps the conversation.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import devices
from .arch import ModelAdapter
from .attention import PoolAttention
from .config import ConfigError, EngineConfig
from .compiled import DecodeStep, pool_attention, stepping
from .fetch import PendingFetch, make_fetcher
from .kv_pool import KVPool, release_pinned_memory
from .policies import POLICIES, PolicyContext, Selection
from .prefix import common_prefix_length
from .rows import export_rows, import_rows
from .stats import DeferredValues, LayerStats, StepStats
from .weights import plain_fp32_weights, weights_label

ATTENTION_NAME = "infinigen"
KEEP_SELECTIONS_STEPS = 16  # decode steps whose selected positions stay inspectable (they stay on the device)
DENSE_UNDER_BUDGET = "dense: context under the budget"


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
    # why the sparse layers attend densely this step (None: they select): when the budget covers every token
    # held, a selection would fetch them all, so rehearsing which to fetch is pure cost
    dense_reason: str | None = None
    prefetched: dict[int, tuple[PendingFetch, Selection | None]] = field(default_factory=dict)
    device_values: list[tuple[LayerStats, torch.Tensor]] = field(default_factory=list)  # sent to the host once
    # after eviction, the slots each sparse layer selected, turned into positions once the step has run
    selected_slots: list[tuple[LayerStats, int, torch.Tensor]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.new_tokens == 1

    @property
    def past_len(self) -> int:
        """Tokens every layer held before this step (the same in every layer)."""
        return self.engine.pool.size() - self.new_tokens

    def selects(self, layer: int) -> bool:
        """Whether `layer` attends over selected rows this step (a sparse layer not made dense by the budget)."""
        return self.dense_reason is None and self.engine.policy.is_sparse(layer)


def _attention_entry(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not kwargs.pop("infinigen_pool", False):  # the model used outside the engine: plain causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer_input, position_embeddings = kwargs["infinigen_layer_input"]
    return pool_attention(module.layer_idx, query, key, value, scaling, layer_input, position_embeddings), None


def _hand_layer_input_to_attention(module, args, kwargs):
    """The attention module's input, passed on to our attention function: speculation for the next layer
    reads it there. A plain function of its arguments, so that a compiled step traces it (see compiled.py)."""
    if not kwargs.get("infinigen_pool", False):
        return None
    return args, {**kwargs, "infinigen_layer_input": (kwargs["hidden_states"], kwargs.get("position_embeddings"))}


_HOOKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # attention modules that carry the pre-hook


def _pass_layer_inputs_on(attention_modules: list[torch.nn.Module]) -> None:
    """One pre-hook per attention module for as long as the model lives, however many engines wrap it: the
    model a compiled step traced stays the model it runs (engines coming and going would change its hooks)."""
    for module in attention_modules:
        if module not in _HOOKED:
            module.register_forward_pre_hook(_hand_layer_input_to_attention, with_kwargs=True)
            _HOOKED.add(module)


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
                 fingerprint: str = "unknown", kernels=None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter.for_model(model)
        self.device = devices.compute_device_for(device)  # INFINIGEN_SEPARATE_DEVICES: CUDA's rules on the CPU
        if devices.is_emulated(self.device):
            devices.tag_module(model)
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            self.dtype = torch.float16
        self.skew_set = skew_set
        self.fingerprint = fingerprint
        self.model_name = "model"  # what the app and the API call it: load_engine names it after its checkpoint
        # cpu_kernels.CpuKernels (float32 on the CPU only): InfiniGen's selection and sparse attention in one pass each
        self.kernels = kernels if self._on_plain_cpu() and self.dtype == torch.float32 else None
        self.legacy_fingerprints: tuple[str, ...] = ()  # what earlier versions called this model (loading.py)
        self.weights = weights_label(model)  # e.g. "int4 weights (head bf16)": what decode steps read (weights.py)
        self.token_ids: list[int] = []
        self.history: deque[StepStats] = deque(maxlen=config.history_steps)
        self.steps_run = 0
        self._attention_modules = self.adapter.attention_modules(model)
        model.set_attn_implementation(ATTENTION_NAME)
        _pass_layer_inputs_on(self._attention_modules)
        self.pool: KVPool | None = None
        self.fetcher = None
        self._ones: torch.Tensor | None = None
        self.decode_step = DecodeStep(model)  # one-token steps: compiled by compiled.compile_decode, else eager
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
            device=self.device if policy_class.keeps_pool_on_device else devices.host_device_for(self.device),
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
        context = PolicyContext(self.pool, config, self.adapter, self._attention_modules, self.device, self.skew_set,
                                self.kernels)
        self.policy = policy_class(context)
        self.attention = PoolAttention(self.pool, self.adapter, self.policy, self.device, self.kernels)
        self._has_sparse_layers = any(self.policy.is_sparse(layer) for layer in range(self.adapter.num_layers))
        if self.fetcher is not None:
            self.fetcher.close()
        self.fetcher = make_fetcher(self.pool, self.device, max_rows=config.budget_tokens_for(self.max_context) + 1,
                                    rows_in_place=self.kernels is not None)

    def prepare(self, new_tokens: int) -> None:
        """Make room now for `new_tokens` more tokens, so no step of the coming reply allocates pool memory."""
        self.pool.ensure_capacity(min(self.pool.total_tokens + new_tokens, self.max_context))
        self.policy.ensure_capacity(self.pool.capacity)

    def close(self) -> None:
        """Stop the fetch worker and free the pool; the engine is unusable after (the model is not: outside an
        engine's step it attends as transformers does)."""
        self.fetcher.close()
        release_pinned_memory(self.pool)

    def __enter__(self) -> InfiniGenEngine:
        """`with InfiniGenEngine(...) as engine:` closes it at the end of the block, whatever happens in it."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ conversation
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_context(self) -> int:
        return self.adapter.max_context

    @torch.inference_mode()
    def prefill(self, token_ids: Iterable[int], progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Append tokens in chunks of `prefill_chunk`; returns the logits [vocab] after the last one.

        Prefill runs the plain fp32 model even where decode steps read compact weights (weights.py): the
        prompt's K/V are the fp32 model's, and so is the first reply token, also when the prompt was cached
        and only its last token runs again (the same seed gives the same reply either way).
        """
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        self._check_fits(len(token_ids))
        self.prepare(len(token_ids))  # the pool sized for the prompt at once, not doubled chunk by chunk
        logits = None
        with plain_fp32_weights(self.model):
            for start in range(0, len(token_ids), self.config.prefill_chunk):
                logits = self._forward(token_ids[start : start + self.config.prefill_chunk], eager=True)[-1]
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
    def truncate(self, n_tokens: int, upcoming: int = 0) -> None:
        """Keep the first n_tokens of the conversation (edit, regenerate); `upcoming`: tokens about to follow.

        Memory goes back when what is left (with `upcoming`) fills under a quarter of the pool (see
        KVPool.release_spare), so a long import or prompt does not pin its size after the session shrank.
        """
        self.fetcher.flush()  # no write in flight into storage that is compacted or given back
        moved = self.pool.truncate(n_tokens)
        del self.token_ids[n_tokens:]
        if self.pool.release_spare(upcoming):
            self.policy.release_capacity(self.pool.capacity)
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
            self.truncate(common, upcoming=len(token_ids) - common)
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
        """K/V rows of positions [start, end) per layer, plus their token ids, as CPU tensors (see rows.py)."""
        self.fetcher.flush()
        return export_rows(self.pool, self.token_ids, start, end)

    @torch.inference_mode()
    def import_rows(self, chunks: Iterable[dict[str, torch.Tensor]]) -> int:
        """Restore exported chunks (in order) after the current tokens, rebuilding partial keys; no model run.

        A chunk's K/V are in any dtype or int8 codes with their scales (rows.py); either way they are written
        straight into the pool's slots.
        """
        self.fetcher.flush()
        restored = import_rows(self.pool, self.token_ids, chunks)
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
    def _forward(self, token_ids: list[int], eager: bool = False) -> torch.Tensor:
        """One forward step over `token_ids`; `eager`: never the compiled one-token step (prefill, whose
        weights differ from the ones it was compiled for, runs a one-token chunk too)."""
        n, first = len(token_ids), self.pool.total_tokens
        # prefill reads the pool from this thread, and a growth copies it into new storage: pending writes
        # (the fetch worker's, of the previous token) land first, or they would land in the old storage
        if n > 1 or self.pool.grows_for(n):
            self.fetcher.flush()
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
        if step.is_decode and self._budget_covers(step.past_len):
            step.dense_reason = stats.dense_reason = DENSE_UNDER_BUDGET
        self.policy.ensure_capacity(self.pool.capacity)
        if step.is_decode and not self.policy.keeps_pool_on_device:
            step.prefetched[0] = self._start_fetch(0, step)  # later layers are started one layer ahead
        started = time.perf_counter()
        run = self.decode_step if step.is_decode and not eager else self.model
        try:
            with stepping(step), devices.decode_step(step.is_decode):
                output = run(
                    input_ids=self._to_device(torch.tensor([token_ids])),
                    position_ids=step.query_positions.unsqueeze(0),
                    # our mask function returns None; passing a mask only spares transformers a look at the
                    # position ids (a host read) for packed sequences
                    attention_mask=self._all_ones(n),
                    use_cache=False,
                    logits_to_keep=1,
                    infinigen_pool=True,
                )
        except BaseException:
            self.policy.finish_step(completed=False)
            if self.pool.truncate(first):
                self.policy.rebuild()
            raise
        self.policy.finish_step(completed=True)
        self._record_selected_positions(step)
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

    def _budget_covers(self, past_len: int) -> bool:
        """A sparse policy's budget (its floor included) reaches every past token: selecting would keep all.
        With no past token at all (a first token decoded alone) there is nothing to select, whatever the config."""
        if not self._has_sparse_layers:
            return False
        if past_len == 0:
            return True
        return self.config.dense_under_budget and self.config.budget_tokens_for(past_len) >= past_len

    def _slots_on_device(self, slots: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.pool.device == self.device:
            return slots
        if self.pool.last_reserved_contiguous:  # every layer shares one tensor: one copy
            return [self._to_device(slots[0])] * len(slots)
        return [self._to_device(layer_slots) for layer_slots in slots]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor to the compute device without waiting (pinned, non-blocking) on a GPU."""
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device) if devices.is_emulated(self.device) else tensor

    def _on_plain_cpu(self) -> bool:
        return self.device.type == "cpu" and not devices.is_emulated(self.device)

    def _all_ones(self, n: int) -> torch.Tensor:
        """[1, n] ones whose strides depend on n only (a compiled step's guards check them)."""
        if self._ones is None or self._ones.shape[0] < n:
            self._ones = torch.ones(max(n, self.config.prefill_chunk), dtype=torch.long, device=self.device)
        return self._ones[:n].unsqueeze(0)

    def _record_selected_positions(self, step: "_Step") -> None:
        """After eviction, the positions of the slots each sparse layer selected: one copy to the host for the
        whole step, after its forward (the logits are read there anyway), instead of a wait in every layer.
        Before the next reserve, which may give those slots to new tokens."""
        if not step.selected_slots:
            return
        slots = torch.stack([layer_slots for _, _, layer_slots in step.selected_slots]).to(self.pool.device)
        for (stats, layer, _), layer_slots in zip(step.selected_slots, slots):
            stats.selected_positions = self.pool.positions(layer)[layer_slots]

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

    def _speculate_next(self, layer: int, layer_input, position_embeddings, step: "_Step") -> None:
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
                step.prefetched[target] = (self.fetcher.start_rows(target, selection.slots), selection)
        elif not self.policy.keeps_pool_on_device:
            step.prefetched[target] = self._start_fetch(target, step)

    def _start_fetch(self, layer: int, step: "_Step") -> tuple[PendingFetch, Selection | None]:
        """Start the fetch of a layer that nothing speculated for: its selected rows, or all of it."""
        if step.selects(layer):
            selection = self.policy.select(layer, step.past_len, step.first_position)
            if selection is not None:
                return self.fetcher.start_rows(layer, selection.slots), selection
        return self.fetcher.start_layer(layer), None

    def _attend(self, step: _Step, layer: int, query, key, value, scaling: float, layer_input, position_embeddings):
        if step.is_decode and layer_input is not None:
            self._speculate_next(layer, layer_input, position_embeddings, step)
        started = time.perf_counter()
        new_keys, new_values = key[0], value[0]  # [kv_heads, n, dim]
        self.fetcher.write(layer, step.slots[layer], new_keys, new_values)
        slots = step.device_slots[layer]
        self.policy.on_write(layer, slots, new_keys)
        stats = LayerStats(layer=layer, context_len=step.past_len, fetched=step.past_len, sparse=False)
        if step.dense_reason is not None and self.policy.is_sparse(layer):
            stats.dense_reason = step.dense_reason
        if not step.is_decode:
            out = self.attention.prefill(layer, query, new_keys, new_values, scaling, step.query_positions, slots)
        else:
            pending, selection = step.prefetched.pop(layer, None) or self._start_fetch(layer, step)
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

    def _record_selection(self, layer, query, key, scaling, selection, stats, step) -> None:
        """What a sparse layer fetched, for the panels and the inspector: no host read here."""
        stats.sparse = True
        stats.fetched = selection.slots.shape[1]
        stats.speculate_ms = selection.speculate_ms
        if self.pool.slots_are_positions:
            stats.selected_positions = selection.slots
        else:  # the slot-to-position map lives on the host: looked up once the step has run, for all layers
            step.selected_slots.append((stats, layer, selection.slots))
        stats.selected_scores = selection.scores
        if selection.alpha_total is not None:
            stats.deferred_from = step.stats
            step.device_values.append((stats, selection.alpha_total))
        if self.config.record_recall:
            self.attention.measure_recall(layer, query, key, scaling, selection, stats)
