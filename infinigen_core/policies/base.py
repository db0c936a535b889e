"""The interface every KV policy implements.

A policy answers one question per sparse layer and decode step: which slots of the pool does this
layer attend to? It may answer early, from the previous layer's attention input (`speculate`, used by
InfiniGen to prefetch), or late, when the layer itself runs (`select`). Returning None means "all rows".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..arch import ModelAdapter
from ..kv_pool import KVPool

if TYPE_CHECKING:  # config validates policy names against the registry, so it imports this package
    from ..config import EngineConfig


@dataclass
class Selection:
    slots: torch.Tensor  # [kv_heads, k] pool slots; k is known on the host (the budget), never read back
    scores: torch.Tensor | None = None  # [kv_heads, k] the policy's score for each slot
    # [1, k + 1] bool over the new token then the slots: which rows attention may use. InfiniGen fetches k rows
    # and masks those past its alpha count, so no shape depends on a device value; its slots come ranked (eager)
    # or partitioned (CPU kernels), either way with the rows the mask keeps first.
    # Where the KV heads share one budget (EngineConfig.budget_by_head) `slots` is wider than each head reads and
    # `valid` is [kv_heads, width + 1], one mask per head; `per_head` is then the mean rows a head reads.
    valid: torch.Tensor | None = None
    alpha_total: torch.Tensor | None = None  # device scalar: query heads x mean tokens within alpha
    speculate_ms: float = 0.0
    per_head: int | None = None

    @property
    def rows_per_head(self) -> int:
        """Past rows a KV head reads, on average over the heads."""
        return self.slots.shape[1] if self.per_head is None else self.per_head


@dataclass
class PolicyContext:
    pool: KVPool
    config: EngineConfig
    adapter: ModelAdapter
    attention_modules: list[torch.nn.Module]
    compute_device: torch.device
    skew_set: object | None = None  # SkewSet, for InfiniGen
    kernels: object | None = None  # cpu_kernels.CpuKernels where the engine runs on the CPU with them built


def selects_rows(layer: int, dense_layers: int, is_global: bool) -> bool:
    """Whether a sparse policy selects rows in `layer`: past the dense first layers, and a global one (a
    sliding-window layer already reads only its window)."""
    return layer >= dense_layers and is_global


class KVPolicy:
    name: ClassVar[str] = "base"
    keeps_pool_on_device: ClassVar[bool] = False  # full: the whole cache lives on the compute device
    needs_attention_weights: ClassVar[bool] = False  # h2o: accumulate attention mass per slot
    needs_skew: ClassVar[bool] = False

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    @property
    def config(self) -> EngineConfig:
        return self.ctx.config

    def is_sparse(self, layer: int) -> bool:
        return selects_rows(layer, self.config.dense_layers, self.ctx.adapter.is_global(layer))

    def budget_for(self, layer: int, past_len: int) -> int:
        """The rows a sparse `layer` may fetch over a past of `past_len` tokens: the config's budget, the same in
        every layer unless the policy spreads it (InfiniGen, budget_shares.py)."""
        return self.config.budget_tokens_for(past_len)

    def width_for(self, layer: int, past_len: int) -> int:
        """The slots a selection of `layer` names per KV head: its budget, or more where the heads share one."""
        return self.width_of(self.budget_for(layer, past_len), past_len)

    def width_of(self, rows: int, past_len: int) -> int:
        """The slots a selection of `rows` rows per KV head names per head (InfiniGen: more where heads share)."""
        return rows

    def max_rows_for(self, context: int) -> int:
        """The most rows any sparse layer fetches over a past of `context` tokens (what fetch buffers hold)."""
        layers = [layer for layer in range(self.ctx.adapter.num_layers) if self.is_sparse(layer)]
        return max((self.width_for(layer, context) for layer in layers), default=self.config.budget_tokens_for(context))

    def speculate(self, layer: int, hidden_states, position_embeddings, positions: torch.Tensor, past_len: int,
                  new_slots: torch.Tensor | None) -> Selection | None:
        """Called before `layer` attends, during decoding, when layer + 1 is sparse: may choose its slots now
        (from this layer's input), so that their fetch overlaps this layer's work. `positions` are the new
        token's positions; `new_slots` (compute device) the slots reserved for it, or None when that is slot
        `past_len`."""
        return None

    def select_from_query(self, layer: int, query: torch.Tensor, past_len: int,
                          new_slots: torch.Tensor | None) -> Selection | None:
        """Called as a sparse `layer` starts attending, during decoding, where nothing was speculated for it:
        may choose its slots from the layer's own query (as attention gets it, [1, heads, 1, dim] in some
        layout whose heads are in order; its scale is the adapter's `logit_scale`); `new_slots` as for
        `speculate`."""
        return None

    def select(self, layer: int, past_len: int, first_position: int) -> Selection | None:
        """Slots for a sparse `layer` that was not speculated for; None means every row."""
        return None

    def on_write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """New keys [kv_heads, n, dim] were written to `slots`."""

    def on_attention(self, layer: int, slots: torch.Tensor | None, probs: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Attention probabilities [kv_heads, group, n, k(+n)] over `slots` (None: all rows) then the new tokens."""

    def finish_step(self, completed: bool) -> None:
        """A forward step ended (`completed` False: it failed and its tokens were taken back)."""

    def rebuild(self, stored: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """The pool's slots were reordered or restored: recompute any per-slot state from it. `stored`: per
        layer, (positions, partial keys [kv_heads, n, r]) saved with the rows, for the layers whose
        `partial_key_digests` the saved ones matched; a policy that keeps partial keys takes them as they are
        for those positions instead of recomputing them (rows.stored_partial_keys)."""

    def partial_key_digests(self) -> dict[int, str]:
        """Per layer that keeps partial keys, a digest of what they depend on beside the keys (a saved layer's
        partial keys are reusable exactly when its digest matches); {} for a policy that keeps none."""
        return {}

    def export_partial_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        """The partial keys of `slots` (pool device) of `layer` as a CPU tensor [kv_heads, n, r], exactly as
        held; None for a layer without them."""
        return None

    def ensure_capacity(self, capacity: int) -> None:
        """The pool holds up to `capacity` slots per layer now: grow per-slot state to match (before a step)."""

    def release_capacity(self, capacity: int) -> None:
        """The pool shrank to `capacity` slots per layer (none in use past it): drop per-slot state past it."""

    def device_bytes(self) -> int:
        """Bytes this policy keeps on the compute device besides the pool."""
        return 0


