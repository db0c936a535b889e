"""The interface every KV policy implements.

A policy answers one question per sparse layer and decode step: which slots of the pool does this
layer attend to? It may answer early, from the previous layer's attention input (`speculate`, used by
InfiniGen to prefetch), or late, when the layer itself runs (`select`). Returning None means "all rows".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..arch import ModelAdapter
from ..config import EngineConfig
from ..kv_pool import KVPool


@dataclass
class Selection:
    slots: torch.Tensor  # [kv_heads, k] pool slots
    scores: torch.Tensor | None = None  # [kv_heads, k] the policy's score for each slot
    alpha_count: float | None = None
    speculate_ms: float = 0.0


@dataclass
class PolicyContext:
    pool: KVPool
    config: EngineConfig
    adapter: ModelAdapter
    attention_modules: list[torch.nn.Module]
    compute_device: torch.device
    skew_set: object | None = None  # SkewSet, for InfiniGen


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
        # a sliding-window layer already reads only its window: selection is for global layers
        return layer >= self.config.dense_layers and self.ctx.adapter.is_global(layer)

    def speculate(self, layer: int, hidden_states, position_embeddings, first_position: int) -> tuple[int, Selection] | None:
        """Called before `layer` attends, during decoding; may return a selection for a later layer."""
        return None

    def select(self, layer: int, past_len: int, first_position: int) -> Selection | None:
        """Slots for a sparse `layer` that was not speculated for; None means every row."""
        return None

    def on_write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """New keys [kv_heads, n, dim] were written to `slots`."""

    def on_attention(self, layer: int, slots: torch.Tensor | None, probs: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Attention probabilities [kv_heads, group, n, k(+n)] over `slots` (None: all rows) then the new tokens."""

    def rebuild(self) -> None:
        """The pool was truncated or restored: recompute any per-slot state from it."""


def eligible_slots(pool: KVPool, layer: int, first_position: int) -> torch.Tensor:
    """Pool slots holding tokens before `first_position` (the past of this step)."""
    return (pool.positions(layer) < first_position).nonzero().squeeze(1)
