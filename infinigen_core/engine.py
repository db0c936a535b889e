"""The engine: an unmodified transformers model whose attention reads from our KV pool.

One forward step, in order:
  1. the pool reserves slots for the new tokens (evicting now, if limited);
  2. the model runs its own forward (at one token, `decode_step`: compiled where compiled.py could, else
     eager; prefill always eager); a pre-hook passes each attention module's input on to our attention;
  3. our registered attention function (one opaque op inside a compiled step) runs step.py's per-layer
     work: speculate and start the next layer's fetch, write the new K/V, attend, record statistics;
  4. the step's statistics are kept for the UI and the benchmarks.
Masks come from the pool's positions, not from transformers, so the mask registration returns None.
The attention maths of step 3 lives in attention.py; a saved session's rows are exported and imported by
session_rows.py (a mixin; the format is rows.py's); the engine attaches to the model, runs the step in this order and keeps the conversation.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import devices
from .arch import ModelAdapter
from .attention import PoolAttention
from .config import ConfigError, EngineConfig
from .compiled import DecodeStep, pool_attention, stepping
from .fetch import DeviceKeeping, make_fetcher
from .kv_pool import KVPool, release_pinned_memory
from .pool_lifecycle import return_freed_heap
from .policies import POLICIES, PolicyContext
from .prefix import common_prefix_length
from .session_rows import SessionRows
from .stats import StepStats
from .step import LayerWork, Step
from .step_inputs import StepInputs
from .weights import plain_fp32_weights, weights_label

ATTENTION_NAME = "infinigen"
KEEP_SELECTIONS_STEPS = 16  # decode steps whose selected positions stay inspectable (they stay on the device)
DENSE_UNDER_BUDGET = "dense: context under the budget"


class ContextOverflowError(ValueError):
    """The conversation would not fit in the model's context window."""


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


class InfiniGenEngine(SessionRows):
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
        self._no_positions = torch.empty(0, dtype=torch.long, device=self.device)  # logits_to_keep: no row
        self.inputs = StepInputs(self.device)  # a step's token ids, positions and slots on the compute device
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
        pool_device = self.device if policy_class.keeps_pool_on_device else devices.host_device_for(self.device)
        layout = dict(
            device=pool_device,
            pin_memory=self.device.type == "cuda" and not policy_class.keeps_pool_on_device,
            limit_tokens=config.pool_limit_tokens,
            sink_tokens=config.sink_tokens,
            recent_window=config.recent_window,
            # a sliding layer reads its last window, rows side by side: off huge pages, whose first write into a
            # fresh pool (a restore) can wait on the kernel's compaction (huge_pages.py)
            sliding_windows={layer: window for layer in range(self.adapter.num_layers)
                             if (window := self.adapter.sliding_window(layer)) is not None},
            # a pool apart from the compute device is read by a fetcher that copies whole layers (make_fetcher)
            defers_restored_rows=pool_device == self.device,
        )
        old_pool = self.pool
        if self.fetcher is not None:
            self.fetcher.flush()  # every pending write lands in the old pool first
        held = self._held_partial_keys()
        if old_pool is None or not old_pool.same_layout(**layout):
            self.pool = KVPool(self.adapter.num_layers, self.adapter.num_kv_heads, self.adapter.head_dim, self.dtype,
                               **layout)
            if old_pool is not None:
                self.pool.copy_from(old_pool)
                release_pinned_memory(old_pool)
        self.config = config
        self.history = deque(self.history, maxlen=config.history_steps)
        context = PolicyContext(self.pool, config, self.adapter, self._attention_modules, self.device, self.skew_set,
                                self.kernels)
        self.policy = policy_class(context)
        self._keep_held_partial_keys(held)  # a restored pool's keys may be int8-rounded (session_rows.py)
        self.attention = PoolAttention(self.pool, self.adapter, self.policy, self.device, self.kernels)
        if self.fetcher is not None:
            self.fetcher.close()
        self.fetcher = make_fetcher(self.pool, self.device, max_rows=self.policy.max_rows_for(self.max_context) + 1,
                                    rows_in_place=self.kernels is not None, zero_copy=config.zero_copy_fetch,
                                    keep=DeviceKeeping.for_policy(self.policy, self.adapter, config))
        self.work = LayerWork(self.pool, self.policy, self.fetcher, self.attention, self.adapter, config)

    def prepare(self, new_tokens: int) -> None:
        """Make room now for `new_tokens` more tokens, so no step of the coming reply allocates pool memory."""
        tokens = min(self.pool.total_tokens + new_tokens, self.max_context)
        if self.pool.grows_to_hold(tokens):
            self.fetcher.flush()  # a growth copies the pool into new storage: every pending write lands first
        self.pool.ensure_capacity(tokens)
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

        Prefill runs the plain fp32 layers even where decode steps read compact weights (weights.py): the
        prompt's K/V are the fp32 model's, also when the prompt was cached and only its last token runs again.
        The output head, run for the last chunk's last token only, keeps its compact form where that is the
        file's own Q8_0 codes (the same logits to float rounding, a quarter of the bytes).
        """
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        self._check_fits(len(token_ids))
        self.prepare(len(token_ids))  # the pool sized for the prompt at once, not doubled chunk by chunk
        chunk = self.config.prefill_chunk
        with plain_fp32_weights(self.model, keep_exact_head=True):
            for start in range(0, len(token_ids), chunk):
                logits = self._forward(token_ids[start : start + chunk], eager=True,
                                       logits=start + chunk >= len(token_ids))
                if progress is not None:
                    progress(min(start + chunk, len(token_ids)), len(token_ids))
        return logits[-1]

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
        KVPool.release_spare), so a long import or prompt does not pin its size after the session shrank;
        once the pool, the policy and the fetcher let go, so do the C heap's free pages (return_freed_heap).
        """
        self.fetcher.flush()  # no write in flight into storage that is compacted or given back
        moved = self.pool.truncate(n_tokens)
        del self.token_ids[n_tokens:]
        if released := self.pool.release_spare(upcoming):
            self.policy.release_capacity(self.pool.capacity)
        if moved:  # eviction had reordered the slots: per-slot state follows the compacted pool
            self.policy.rebuild()
        if moved or released:  # what the device keeps of the pool follows it
            self.fetcher.rebuild()
        if released:
            return_freed_heap()

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

    # ------------------------------------------------------------------ one forward step
    @torch.inference_mode()
    def _forward(self, token_ids: list[int], eager: bool = False, logits: bool = True) -> torch.Tensor:
        """One forward step over `token_ids`: the logits [1, vocab] after the last one, or [0, vocab] without
        `logits` (a prefill chunk before the last: the output head reads no row). `eager`: never the compiled
        one-token step (prefill, whose weights differ from the ones it was compiled for, runs a one-token chunk
        too)."""
        n, first = len(token_ids), self.pool.total_tokens
        # prefill reads the pool from this thread, and a growth copies it into new storage: pending writes
        # (the fetch worker's, of the previous token) land first, or they would land in the old storage; a
        # one-token step waits at least for the writes that its in-place gathers read (settle)
        self.fetcher.flush() if n > 1 or self.pool.grows_to_hold(self.pool.size() + n) else self.fetcher.settle()
        stats = StepStats(step=self.steps_run, position=first, new_tokens=n)
        slots = self.pool.reserve(n)
        input_ids, query_positions, device_slots = self.inputs.for_step(token_ids, first, slots, self.pool)
        step = Step(
            work=self.work,
            first_position=first,
            new_tokens=n,
            slots=slots,
            device_slots=device_slots,
            query_positions=query_positions,
            stats=stats,
        )
        if step.is_decode and self.work.budget_covers(step.past_len):
            step.dense_reason = stats.dense_reason = DENSE_UNDER_BUDGET
        self.policy.ensure_capacity(self.pool.capacity)
        if step.is_decode and not self.policy.keeps_pool_on_device:
            step.prefetched[0] = self.work.start_fetch(0, step)  # later layers are started one layer ahead
        started = time.perf_counter()
        run = self.decode_step if step.is_decode and not eager else self.model
        lane = self.work.lane if step.is_decode else None  # decode_lane.py: the layers' attention in C++
        try:
            if lane is not None:
                lane.begin(step)
            with stepping(step), devices.decode_step(step.is_decode):
                output = run(
                    input_ids=input_ids,
                    position_ids=step.query_positions.unsqueeze(0),
                    # our mask function returns None; passing a mask only spares transformers a look at the
                    # position ids (a host read) for packed sequences
                    attention_mask=self._all_ones(n),
                    use_cache=False,
                    logits_to_keep=1 if logits else self._no_positions,
                    infinigen_pool=True,
                )
            if step.lane is not None:
                step.lane.end(step)  # closes this thread's lane first, whatever follows
        except BaseException:
            if step.lane is not None:
                step.lane.abort()
            self.policy.finish_step(completed=False)
            if self.pool.truncate(first):
                self.policy.rebuild()
                self.fetcher.rebuild()
            raise
        self.policy.finish_step(completed=True)
        self.work.finish(step)
        self.token_ids.extend(token_ids)
        self.steps_run += 1
        stats.total_ms = (time.perf_counter() - started) * 1e3
        stats.pool_bytes = self.pool.bytes_allocated()
        stats.device_bytes = self.device_bytes()
        if len(self.history) > KEEP_SELECTIONS_STEPS:
            self.history[-KEEP_SELECTIONS_STEPS].drop_selections()
        self.history.append(stats)
        return output.logits[0].float()

    def _on_plain_cpu(self) -> bool:
        return self.device.type == "cpu" and not devices.is_emulated(self.device)

    def _all_ones(self, n: int) -> torch.Tensor:
        """[1, n] ones whose strides depend on n only (a compiled step's guards check them)."""
        if self._ones is None or self._ones.shape[0] < n:
            self._ones = torch.ones(max(n, self.config.prefill_chunk), dtype=torch.long, device=self.device)
        return self._ones[:n].unsqueeze(0)

    def device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        partial = self.policy.device_bytes()
        on_device = self.pool.bytes_allocated() if self.policy.keeps_pool_on_device else 0
        return partial + on_device + self.fetcher.device_bytes()
