"""Per-step statistics: what each layer fetched, how long it took, and what the pool holds.

The engine produces one `StepStats` per forward step; the UI panels and the benchmarks read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    layer: int
    context_len: int  # past tokens this layer could attend to
    fetched: int  # past tokens it did attend to (per KV head)
    sparse: bool  # False for dense layers and dense policies
    alpha_count: float | None = None  # InfiniGen: mean tokens within alpha of the max rehearsed logit
    speculate_ms: float = 0.0
    fetch_wait_ms: float = 0.0
    compute_ms: float = 0.0
    attention_recall: float | None = None  # true attention mass covered by the fetched set
    tokens_for_90: int | None = None  # tokens the true attention needs for 90% of its mass
    selected_positions: torch.Tensor | None = None  # [kv_heads, k] token positions
    selected_scores: torch.Tensor | None = None  # [kv_heads, k] rehearsed score of each
    # Only with record_recall: the dense attention over past tokens (mean over heads) and their positions.
    true_attention: torch.Tensor | None = None  # [past]
    true_attention_positions: torch.Tensor | None = None  # [past]

    @property
    def fetched_ratio(self) -> float:
        return self.fetched / self.context_len if self.context_len else 1.0


@dataclass
class StepStats:
    step: int
    position: int  # position of the first token of this step
    new_tokens: int  # 1 while decoding, the chunk length while prefilling
    layers: list[LayerStats] = field(default_factory=list)
    pool_bytes: int = 0
    device_bytes: int = 0
    total_ms: float = 0.0

    @property
    def is_decode(self) -> bool:
        return self.new_tokens == 1

    def sparse_layers(self) -> list[LayerStats]:
        return [s for s in self.layers if s.sparse]

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
            "per_layer_fetched_ratio": [s.fetched_ratio for s in self.layers],
            "pool_bytes": self.pool_bytes,
            "device_bytes": self.device_bytes,
            **{f"{k}_ms": v for k, v in self.time_split_ms().items()},
        }
