"""Record the post-RoPE queries and keys of a calibration text and turn them into a skew set.

Runs the model once, densely, with a recording attention function swapped in for the duration.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .arch import ModelAdapter
from .skew import SkewSet, skew_from_states

RECORDING_ATTENTION = "infinigen_calibration"


def _recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    recorder = kwargs.pop("calibration_recorder")
    recorder[module.layer_idx] = (query[0].detach().float().cpu(), key[0].detach().float().cpu())
    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout, is_causal=True)


AttentionInterface.register(RECORDING_ATTENTION, _recording_attention)
AttentionMaskInterface.register(RECORDING_ATTENTION, lambda *args, **kwargs: None)


def calibration_text() -> str:
    """The text shipped with the project for calibrating real models (written for this project)."""
    return resources.files("infinigen_core.data").joinpath("calibration.txt").read_text(encoding="utf-8")


def calibration_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(str(token_ids).encode()).hexdigest()[:12]


@torch.inference_mode()
def calibrate(model: torch.nn.Module, token_ids: list[int], device: str | torch.device = "cpu") -> SkewSet:
    adapter = ModelAdapter.for_model(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDING_ATTENTION)
    recorder: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        positions = torch.arange(len(token_ids), device=device).unsqueeze(0)
        model(
            input_ids=torch.tensor([token_ids], device=device),
            position_ids=positions,
            use_cache=False,
            logits_to_keep=1,
            calibration_recorder=recorder,
        )
    finally:
        model.set_attn_implementation(previous)
    skews, scores = [], []
    for layer in range(adapter.num_layers):
        queries, keys = recorder[layer]
        skew, score = skew_from_states(queries, keys, adapter.group_size)
        skews.append(skew)
        scores.append(score)
    return SkewSet(tuple(skews), tuple(scores))
