"""Record the post-RoPE queries and keys of a calibration text and turn them into a skew set.

Runs the model once, densely, with a recording attention function swapped in for the duration. What is
recorded is what each layer's attention receives, so every family's own projection, norms and positional
encoding are in it: a layer without RoPE (SmolLM3's NoPE layers) is skewed without it. The same record gives
each layer's attention curve (budget_shares.py), how flat its attention is.
"""

from __future__ import annotations

import hashlib
import sys
from importlib import resources

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask

from .arch import ModelAdapter
from .budget_shares import attention_curve
from .skew import SkewSet, skew_from_states

RECORDING_ATTENTION = "infinigen_calibration"


def _recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    recorder = kwargs.pop("calibration_recorder")
    # float32 for the eigen-decomposition, whatever the model computes in (bf16/fp16 on a GPU)
    recorder[module.layer_idx] = (query[0].detach().float().cpu(), key[0].detach().float().cpu())
    if kwargs.get("softcap") is not None:  # SDPA cannot soft-cap: the family's own eager attention can (Gemma 2)
        family_attention = sys.modules[type(module).__module__].eager_attention_forward
        return family_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(RECORDING_ATTENTION, _recording_attention)
# transformers' own masks (additive, which both SDPA and eager take), so sliding-window layers see only their
# window while the model is calibrated
AttentionMaskInterface.register(RECORDING_ATTENTION, eager_mask)


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
    skews, scores, curves = [], [], []
    for layer in range(adapter.num_layers):
        queries, keys = recorder[layer]
        skew, score = skew_from_states(queries, keys, adapter.group_size)
        skews.append(skew)
        scores.append(score)
        curves.append(attention_curve(queries, keys, adapter.group_size, adapter.logit_scale, adapter.softcap))
    return SkewSet(tuple(skews), tuple(scores), tuple(curves))
