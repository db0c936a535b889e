"""Offline skewing: per layer and KV head an orthogonal matrix that packs query/key energy into few channels.

With Q = U S Vᵀ (SVD of the calibration queries of one KV head's query group; V is taken from the
eigenvectors of QᵀQ), A = V is orthogonal, so
(QA)(KA)ᵀ = QKᵀ exactly, while QA = US has its energy in the leading columns. The partial channels of a
head are the columns with the largest mean |QA| + |KA|; only they enter the speculation.

The matrices depend on the model alone, so they are computed once and cached on disk under the model's
fingerprint; the channel scores are stored too, so any partial ratio can be derived without recalibrating,
and each layer's attention curve (budget_shares.py), from which any budget is spread over the layers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

SKEW_FORMAT_VERSION = "2"  # 2: with the attention curves


@dataclass(frozen=True)
class SkewSet:
    """Per layer: skew [kv_heads, dim, dim], channel scores [kv_heads, dim] and attention curve
    [len(budget_shares.CURVE_FRACTIONS)] (None: not measured, and every layer gets the uniform budget)."""

    skews: tuple[torch.Tensor, ...]
    channel_scores: tuple[torch.Tensor, ...]
    attention_curves: tuple[torch.Tensor, ...] | None = None

    def partial_projection(self, layer: int, partial_ratio: float) -> torch.Tensor:
        """[kv_heads, dim, r]: the skew columns of the r strongest channels of each KV head."""
        skew, scores = self.skews[layer], self.channel_scores[layer]
        channels = max(1, int(round(partial_ratio * skew.shape[-1])))
        top = scores.topk(channels, dim=-1).indices  # [kv_heads, r]
        return torch.gather(skew, 2, top.unsqueeze(1).expand(-1, skew.shape[1], -1))

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for tensor in self.skews[:2] + self.channel_scores[:2]:
            digest.update(tensor.float().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


def skew_from_states(queries: torch.Tensor, keys: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """queries [heads, T, dim], keys [kv_heads, T, dim] of one layer -> (skew, channel_scores) per KV head."""
    kv_heads, _, dim = keys.shape
    skews, scores = [], []
    for kv in range(kv_heads):
        group_queries = queries[kv * group_size : (kv + 1) * group_size].reshape(-1, dim).double()
        # The right singular vectors of Q are the eigenvectors of QᵀQ (dim x dim): cheap for any T, and
        # square (orthogonal) even when the calibration text is shorter than the head dimension.
        _, eigenvectors = torch.linalg.eigh(group_queries.T @ group_queries)
        skew = eigenvectors.flip(-1)  # strongest direction first, like the SVD's order
        head_keys = keys[kv].double()
        score = (group_queries @ skew).abs().mean(0) + (head_keys @ skew).abs().mean(0)
        skews.append(skew.float())
        scores.append(score.float())
    return torch.stack(skews), torch.stack(scores)


def save_skew(path: Path, skew_set: SkewSet, meta: dict[str, str]) -> None:
    tensors = {}
    for layer, (skew, score) in enumerate(zip(skew_set.skews, skew_set.channel_scores)):
        tensors[f"skew.{layer}"] = skew.contiguous()
        tensors[f"scores.{layer}"] = score.contiguous()
    for layer, curve in enumerate(skew_set.attention_curves or ()):
        tensors[f"curve.{layer}"] = curve.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={**meta, "format": SKEW_FORMAT_VERSION})
    tmp.replace(path)


def load_skew(path: Path, num_layers: int) -> SkewSet | None:
    """The cached skew set, or None when the file is missing, foreign, damaged or from before the attention
    curves (format 1: calibrated again, once)."""
    try:
        tensors = load_file(str(path))
        skews = tuple(tensors[f"skew.{layer}"] for layer in range(num_layers))
        scores = tuple(tensors[f"scores.{layer}"] for layer in range(num_layers))
        curves = tuple(tensors[f"curve.{layer}"] for layer in range(num_layers))
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError):
        return None
    if any(not torch.isfinite(t).all() for t in skews + curves):
        return None
    return SkewSet(skews, scores, curves)


def is_orthogonal(matrix: torch.Tensor, tol: float = 1e-4) -> bool:
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype)
    return bool(torch.allclose(matrix.transpose(-1, -2) @ matrix, eye.expand_as(matrix), atol=tol))

