"""Per-step statistics: what each layer fetched, how long it took, and what the pool holds.

The engine produces one `StepStats` per forward step; the UI panels and the benchmarks read them. Values
that live on the compute device (InfiniGen's alpha counts) are not read per layer: the engine stacks them
once per step and starts one non-blocking copy to the host (`DeferredValues`); they are filled in when
someone reads the step, normally a step later, when the copy has long finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    layer: int
    context_len: int  # past tokens this layer could attend to
    fetched: int  # past tokens it did attend to (per KV head); a sliding layer: its window's
    sparse: bool  # False for dense layers, sliding layers and dense policies
    # why a layer the policy makes sparse attended densely this step (engine.DENSE_UNDER_BUDGET), else None
    dense_reason: str | None = None
    window: int | None = None  # a sliding-window layer's window (it reads its last window - 1 past tokens)
    speculate_ms: float = 0.0
    fetch_wait_ms: float = 0.0
    compute_ms: float = 0.0
    attention_recall: float | None = None  # true attention mass covered by the fetched set
    tokens_for_90: int | None = None  # tokens the true attention needs for 90% of its mass
    selected_positions: torch.Tensor | None = None  # [kv_heads, width] token positions (compute device)
    selected_scores: torch.Tensor | None = None  # [kv_heads, width] rehearsed score of each (compute device)
    # [1 or kv_heads, width] bool: which of them attention read (InfiniGen's alpha mask, and where the KV heads share
    # a budget each head's count: the width is then 2k, past a head's rows masked slots that may repeat them)
    selected_read: torch.Tensor | None = None
    # Only with record_recall: the dense attention over past tokens (mean over heads) and their positions.
    true_attention: torch.Tensor | None = None  # [past]
    true_attention_positions: torch.Tensor | None = None  # [past]
    # InfiniGen's alpha count arrives from the device a step later (see DeferredValues): read it through
    # the properties below, which fill it in when it is first asked for.
    deferred_from: "StepStats | None" = field(default=None, repr=False, compare=False)
    resolved_alpha_count: float | None = field(default=None, repr=False)

    @property
    def alpha_count(self) -> float | None:
        """InfiniGen: mean over query heads of the past tokens within alpha of the top rehearsed logit."""
        if self.deferred_from is not None:
            self.deferred_from.resolve()
        return self.resolved_alpha_count

    @property
    def attended(self) -> int:
        """Fetched tokens that attention used: InfiniGen masks those past its alpha count."""
        count = self.alpha_count
        return self.fetched if count is None else min(self.fetched, max(1, math.ceil(count - 1e-9)))

    @property
    def fetched_ratio(self) -> float:
        """Past tokens read over past tokens held: a selection's share, or a sliding layer's window's."""
        return self.fetched / self.context_len if self.context_len else 1.0

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


@dataclass
class DeferredValues:
    """Device scalars of one step on their way to the host: `host` fills once `ready` (an event) is done."""

    host: torch.Tensor  # [n] float64, filled by a non-blocking copy
    ready: object | None  # a torch.cuda.Event, or None when the copy was synchronous (CPU)
    targets: list[tuple[LayerStats, int]]  # who gets each value: (layer stats, query heads to average over)


@dataclass
class StepStats:
    step: int
    position: int  # position of the first token of this step
    new_tokens: int  # 1 while decoding, the chunk length while prefilling
    layers: list[LayerStats] = field(default_factory=list)
    pool_bytes: int = 0
    device_bytes: int = 0
    total_ms: float = 0.0
    deferred: DeferredValues | None = None
    dense_reason: str | None = None  # set when the sparse layers attended densely (see LayerStats.dense_reason)

    def resolve(self) -> "StepStats":
        """Fill in the values that were still on the device (waits only if their copy is still running)."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            if deferred.ready is not None:
                deferred.ready.synchronize()
            for (layer, heads), total in zip(deferred.targets, deferred.host.tolist()):
                layer.resolved_alpha_count = total / heads
                layer.deferred_from = None
        return self

    def drop_selections(self) -> None:
        """Forget the per-layer selected positions (they stay on the device and are large at long contexts)."""
        for layer in self.layers:
            layer.selected_positions = layer.selected_scores = layer.selected_read = None

    @property
    def is_decode(self) -> bool:
        return self.new_tokens == 1

    def sparse_layers(self) -> list[LayerStats]:
        return [s for s in self.layers if s.sparse]

    def sliding_layers(self) -> list[LayerStats]:
        return [s for s in self.layers if s.is_sliding]

    def sliding_fetched_ratio(self) -> float | None:
        """Mean fetched ratio over the sliding-window layers (their window over the context), None without any."""
        sliding = self.sliding_layers()
        return sum(s.fetched_ratio for s in sliding) / len(sliding) if sliding else None

    def fetched_ratio(self) -> float:
        """Mean fetched ratio over the sparse layers (1.0 when every layer is dense)."""
        sparse = self.sparse_layers()
        if not sparse:
            return 1.0
        return sum(s.fetched_ratio for s in sparse) / len(sparse)

    def time_split_ms(self) -> dict[str, float]:
        return {
            "speculate": sum(s.speculate_ms for s in self.layers),
            "fetch_wait": sum(s.fetch_wait_ms for s in self.layers),
            "attention": sum(s.compute_ms for s in self.layers),
            "total": self.total_ms,
        }

    def summary(self) -> dict:
        """A JSON-friendly digest without tensors."""
        return {
            "step": self.step,
            "position": self.position,
            "fetched_ratio": self.fetched_ratio(),
            "sliding_fetched_ratio": self.sliding_fetched_ratio(),
            "dense_reason": self.dense_reason,
            "per_layer_fetched_ratio": [s.fetched_ratio for s in self.layers],
            "pool_bytes": self.pool_bytes,
            "device_bytes": self.device_bytes,
            **{f"{k}_ms": v for k, v in self.time_split_ms().items()},
        }
