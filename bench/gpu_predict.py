"""The GPU table predicted from bytes moved per decode step, to set beside a measured run.

    python -m bench gpu --predict --device-profile h100 --save docs/results/gpu-predicted.json

At batch 1 a decode step is bound by memory traffic, so each policy's step time is estimated from what it
moves and over which link:

- every policy reads all weights once from the GPU's memory (HBM);
- `full` also reads the whole KV cache from HBM;
- `offload` (FlexGen-style) copies every layer's whole KV from pinned host memory over PCIe, one layer ahead,
  so the copy hides behind the compute and the step takes the longer of the two (plus the first layer's copy,
  which nothing hides);
- `hf-offload` (`DynamicCache(offloading=True)`) copies each layer's KV to the GPU and back again from
  pageable memory, which CUDA copies synchronously: nothing overlaps;
- `infinigen` copies the dense layers whole and the budget's share of the other layers' rows over PCIe,
  one layer ahead, after the host gathers those rows into pinned staging (host memory bandwidth); on the GPU it
  also reads the partial keys that speculation scores.

The figures of a profile are stated, not measured: HBM from the vendor's sheet, 50 GB/s pinned over PCIe Gen5
x16, 12 GB/s for pageable copies, and 25 GB/s for the host gathering rows with several threads. The gather is
the least certain figure and the one InfiniGen's speed-up over `offload` hangs on: `offload` copies whole
layers straight from pinned memory, InfiniGen must first gather the chosen rows, so below budget x PCIe rate
the gather, not the link, bounds it. `--h2d-gbps` replaces the PCIe figure with a measured peak. Kernel launches, attention
arithmetic and synchronisation are left out, so a measured step is slower than its prediction: the point is
the ratios between policies and how they move with the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .gpu import SHAPES, ModelShape, add_ratios


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hbm_gbps: float  # the GPU's memory bandwidth, GB/s (10^9 bytes)
    pinned_h2d_gbps: float  # host -> device over PCIe from pinned memory
    pageable_gbps: float  # host <-> device from pageable memory (staged through a driver buffer)
    host_gather_gbps: float  # the host's threads gathering selected rows into pinned staging


PROFILES = {
    "h100": DeviceProfile("H100 SXM (predicted)", hbm_gbps=3350.0, pinned_h2d_gbps=50.0, pageable_gbps=12.0,
                          host_gather_gbps=25.0),
    "h200": DeviceProfile("H200 (predicted)", hbm_gbps=4800.0, pinned_h2d_gbps=50.0, pageable_gbps=12.0,
                          host_gather_gbps=25.0),
}
FP16_BYTES = 2
DENSE_LAYERS = 2  # EngineConfig.dense_layers: the first layers attend over every token
PARTIAL_RATIO = 0.5  # EngineConfig.partial_ratio: the share of key channels speculation reads


def weight_bytes(shape: ModelShape) -> int:
    """fp16 bytes a decode step reads: every layer's projections and MLP, the output head (one embedding row
    read for the input is negligible)."""
    head_dim = shape.hidden // shape.heads
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_heads * head_dim
    mlp = 3 * shape.hidden * shape.intermediate
    return FP16_BYTES * (shape.layers * (attention + mlp + 2 * shape.hidden) + shape.vocab * shape.hidden)


def kv_bytes_per_token_layer(shape: ModelShape) -> int:
    return 2 * shape.kv_heads * (shape.hidden // shape.heads) * FP16_BYTES


def predict_step(shape: ModelShape, context: int, policy: str, budget: float | None,
                 profile: DeviceProfile) -> dict:
    """One row in the measured table's shape: ms_per_token, bytes_fetched_per_token, fetch wait, memory."""
    per_layer = kv_bytes_per_token_layer(shape)
    kv_all = context * per_layer * shape.layers
    weights = weight_bytes(shape)
    compute_s = weights / (profile.hbm_gbps * 1e9)
    fetched = wait_s = None
    gpu_bytes = weights
    if policy == "full":
        step_s = compute_s + kv_all / (profile.hbm_gbps * 1e9)
        gpu_bytes += kv_all
    elif policy == "offload":
        fetched = kv_all
        first_layer_s = context * per_layer / (profile.pinned_h2d_gbps * 1e9)
        step_s = max(compute_s, fetched / (profile.pinned_h2d_gbps * 1e9)) + first_layer_s
        wait_s = step_s - compute_s
        gpu_bytes += 2 * context * per_layer  # two layers in flight
    elif policy == "hf-offload":
        step_s = compute_s + 2 * kv_all / (profile.pageable_gbps * 1e9)  # to the GPU and back, unoverlapped
        gpu_bytes += context * per_layer
    elif policy == "infinigen":
        if budget is None:
            raise ValueError("infinigen needs a budget")
        sparse = shape.layers - DENSE_LAYERS
        fetched = int(DENSE_LAYERS * context * per_layer + sparse * budget * context * per_layer)
        partial_keys = sparse * context * shape.kv_heads * (shape.hidden // shape.heads) * PARTIAL_RATIO * FP16_BYTES
        compute_s += partial_keys / (profile.hbm_gbps * 1e9)
        transfer_s = max(fetched / (profile.pinned_h2d_gbps * 1e9), fetched / (profile.host_gather_gbps * 1e9))
        first_layer_s = context * per_layer / (profile.pinned_h2d_gbps * 1e9)
        step_s = max(compute_s, transfer_s) + first_layer_s
        wait_s = step_s - compute_s
        gpu_bytes += int(partial_keys) + 2 * context * per_layer
    else:
        raise ValueError(f"no prediction for policy {policy!r}")
    ms = step_s * 1e3
    return {"model": shape.name, "context": context, "policy": policy,
            "budget": budget if policy == "infinigen" else None, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
            "bytes_fetched_per_token": fetched,
            "fetch_wait_ms_per_step": wait_s * 1e3 if wait_s is not None else None,
            "h2d_gbps": fetched / step_s / 1e9 if fetched else None, "peak_h2d_gbps": profile.pinned_h2d_gbps,
            "peak_gpu_bytes": gpu_bytes}


def predict_table(shape_names: Sequence[str], contexts: Sequence[int], policies: Sequence[str],
                  budgets: Sequence[float], profile: DeviceProfile) -> dict:
    rows = []
    for shape_name in shape_names:
        for context in contexts:
            for policy in policies:
                for budget in (budgets if policy == "infinigen" else [None]):
                    rows.append(predict_step(SHAPES[shape_name], context, policy, budget, profile))
    add_ratios(rows)
    return {"cuda": False, "predicted": True, "device": profile.name, "profile": vars(profile), "rows": rows}


def profile_named(name: str, h2d_gbps: float | None = None) -> DeviceProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown device profile {name!r}: choose from {', '.join(PROFILES)}")
    profile = PROFILES[name]
    return replace(profile, pinned_h2d_gbps=h2d_gbps) if h2d_gbps else profile
