"""The GPU table predicted for this code's design, to set beside a measured run.

    python -m bench gpu --predict --device-profile h100 --save docs/results/gpu-predicted.json
    python -m bench gpu --predict --device-profile docs/results/gpu-probe-h100.json   # measured rates

The bytes each policy moves per decode step are the engine's own count (`fetcher.bytes_fetched`, held to
it by tests/test_gpu_bench.py): the pool holds the new token when a layer is fetched, InfiniGen fetches
`EngineConfig.budget_tokens_for(context)` rows per KV head of each sparse layer; its dense layers stay on
the GPU (`dense_layers_on_device`, resident.py) and move nothing.
Time per step, eager PyTorch, per decoder layer (what the code does on CUDA today, audit §1.3 and §2.1):

- the host launches every layer's kernels (`host_ms_per_layer`); the GPU reads the layer's weights (and
  under `full` its KV) from HBM; the step is bound by the slower of the two, layer by layer;
- `offload` copies each whole layer from pinned memory by DMA one layer ahead on a side stream: a layer
  takes the longest of launch, compute and its copy, and the first layer's copy hides behind nothing;
- `hf-offload` (transformers' `DynamicCache(offloading=True)`) prefetches the next layer the same way
  (pinned, non-blocking, on its own stream) and sends the layer back to the host after use: as `offload`
  with the copy back in the other direction of the full-duplex link;
- `infinigen` keeps its dense layers on the GPU (they cost what `full`'s layers cost); for each sparse layer the host waits on the
  fetch worker, which waits for the GPU's indices (`round_trip_ms`) and gathers the rows into pinned
  staging (`host_gather_gbps`) before the copy up: the host never runs more than a layer ahead, so the
  round trip and the gather add to the layer's time; its speculation adds launches
  (`sparse_extra_host_ms`) and reads the partial keys from HBM.

Rates come from a profile (stated: vendor sheets and the audit's estimates) or from a measured-rates JSON
written by scripts/gpu_probe.py. No CUDA graph and no zero-copy gather: this design has neither yet, so the
prediction does not either. The GPU cache of selected rows (`selected_rows_cache`) is off by default and
its hit rate unmeasured on real attention, so no row assumes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .gpu import SHAPES, ModelShape, add_ratios, bench_config


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hbm_gbps: float  # the GPU's memory bandwidth, GB/s (10^9 bytes)
    pinned_h2d_gbps: float  # host -> device over PCIe from pinned memory
    pinned_d2h_gbps: float  # device -> host into pinned memory (the other direction of a full-duplex link)
    host_gather_gbps: float  # the host's threads gathering selected rows into pinned staging
    host_ms_per_layer: float  # eager: the host's time to launch one decoder layer's kernels
    sparse_extra_host_ms: float  # InfiniGen per sparse layer: speculation's launches, the fetch hand-off
    round_trip_ms: float  # per sparse layer: indices to the host, the worker's event wait, the hand-off back
    rates: str = "stated"  # or the measured-rates file they came from


PROFILES = {
    "h100": DeviceProfile("H100 SXM (predicted)", hbm_gbps=3350.0, pinned_h2d_gbps=50.0, pinned_d2h_gbps=50.0,
                          host_gather_gbps=25.0, host_ms_per_layer=0.6, sparse_extra_host_ms=0.3,
                          round_trip_ms=0.05),
    "h200": DeviceProfile("H200 (predicted)", hbm_gbps=4800.0, pinned_h2d_gbps=50.0, pinned_d2h_gbps=50.0,
                          host_gather_gbps=25.0, host_ms_per_layer=0.6, sparse_extra_host_ms=0.3,
                          round_trip_ms=0.05),
}
FP16_BYTES = 2


def weight_bytes(shape: ModelShape, element_bytes: int = FP16_BYTES) -> int:
    """Bytes a decode step reads: every layer's projections and MLP, the output head (one embedding row read
    for the input is negligible)."""
    head_dim = shape.hidden // shape.heads
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_heads * head_dim
    mlp = 3 * shape.hidden * shape.intermediate
    return element_bytes * (shape.layers * (attention + mlp + 2 * shape.hidden) + shape.vocab * shape.hidden)


def kv_bytes_per_token_layer(shape: ModelShape, element_bytes: int = FP16_BYTES) -> int:
    """K and V of one token in one layer, every KV head."""
    return 2 * shape.kv_heads * (shape.hidden // shape.heads) * element_bytes


def fetched_bytes(shape: ModelShape, context: int, policy: str, budget: float | None,
                  element_bytes: int = FP16_BYTES) -> int:
    """What the engine's fetcher counts for one decode step over `context` past tokens (bytes_fetched)."""
    per_token = kv_bytes_per_token_layer(shape, element_bytes)
    held = context + 1  # a layer is fetched after the new token's slot was reserved
    if policy in ("full", "hf-offload"):
        return 0  # full reads its cache in place; hf-offload is not the engine (its copies: see predict_step)
    if policy == "offload":
        return shape.layers * held * per_token
    if policy != "infinigen":
        raise ValueError(f"no prediction for policy {policy!r}")
    if budget is None:
        raise ValueError("infinigen needs a budget")
    config = bench_config(budget)
    dense = min(config.dense_layers, shape.layers)
    rows = config.budget_tokens_for(context)
    dense_bytes = 0 if config.dense_layers_on_device else dense * held * per_token
    return dense_bytes + (shape.layers - dense) * rows * per_token


def predict_step(shape: ModelShape, context: int, policy: str, budget: float | None, profile: DeviceProfile,
                 element_bytes: int = FP16_BYTES) -> dict:
    """One row in the measured table's shape: ms_per_token, bytes_fetched_per_token, fetch wait, memory."""
    per_token = kv_bytes_per_token_layer(shape, element_bytes)
    layer_kv = (context + 1) * per_token
    weights = weight_bytes(shape, element_bytes)
    layer_weights_s = weights / shape.layers / (profile.hbm_gbps * 1e9)
    host_s = profile.host_ms_per_layer / 1e3
    h2d_s, d2h_s = layer_kv / (profile.pinned_h2d_gbps * 1e9), layer_kv / (profile.pinned_d2h_gbps * 1e9)
    fetched = fetched_bytes(shape, context, policy, budget, element_bytes)
    gpu_bytes = weights
    if policy == "full":
        step_s = shape.layers * max(host_s, layer_weights_s + layer_kv / (profile.hbm_gbps * 1e9))
        gpu_bytes += shape.layers * layer_kv
        busy_s = step_s
    elif policy in ("offload", "hf-offload"):
        back_s = d2h_s if policy == "hf-offload" else 0.0
        step_s = h2d_s + shape.layers * max(host_s, layer_weights_s, h2d_s, back_s)
        busy_s = shape.layers * max(host_s, layer_weights_s)
        gpu_bytes += 2 * layer_kv  # two layers in flight
    else:
        step_s, busy_s, partial_bytes = _infinigen_step(shape, context, budget, profile, element_bytes)
        dense = min(bench_config(budget).dense_layers, shape.layers)
        gpu_bytes += partial_bytes + dense * layer_kv  # the dense layers' KV, resident
    ms = step_s * 1e3
    moved = fetched or (2 * shape.layers * layer_kv if policy == "hf-offload" else 0)
    return {"model": shape.name, "context": context, "policy": policy,
            "budget": budget if policy == "infinigen" else None, "ms_per_token": ms, "tokens_per_s": 1e3 / ms,
            "bytes_fetched_per_token": fetched,
            "fetch_wait_ms_per_step": (step_s - busy_s) * 1e3 if policy != "full" else None,
            "h2d_gbps": moved / step_s / 1e9 if moved else None, "peak_h2d_gbps": profile.pinned_h2d_gbps,
            "peak_gpu_bytes": gpu_bytes}


def _infinigen_step(shape: ModelShape, context: int, budget: float | None, profile: DeviceProfile,
                    element_bytes: int) -> tuple[float, float, int]:
    """(step seconds, seconds the layers' own work takes, partial-key bytes on the GPU) for InfiniGen."""
    if budget is None:
        raise ValueError("infinigen needs a budget")
    config = bench_config(budget)
    per_token = kv_bytes_per_token_layer(shape, element_bytes)
    head_dim = shape.hidden // shape.heads
    dense = min(config.dense_layers, shape.layers)
    sparse = shape.layers - dense
    layer_kv = (context + 1) * per_token
    rows_bytes = config.budget_tokens_for(context) * per_token
    partial_layer = context * shape.kv_heads * head_dim * config.partial_ratio * element_bytes
    hbm = profile.hbm_gbps * 1e9
    layer_weights_s = weight_bytes(shape, element_bytes) / shape.layers / hbm
    host_s = profile.host_ms_per_layer / 1e3
    dense_s = max(host_s, layer_weights_s + layer_kv / hbm)  # resident: read from HBM as `full` does
    sparse_busy_s = max(host_s + profile.sparse_extra_host_ms / 1e3, layer_weights_s + (partial_layer + rows_bytes) / hbm)
    sparse_s = (max(sparse_busy_s, rows_bytes / (profile.pinned_h2d_gbps * 1e9)) + profile.round_trip_ms / 1e3
                + rows_bytes / (profile.host_gather_gbps * 1e9))
    step_s = dense * dense_s + sparse * sparse_s  # the first layer is dense and resident: no copy to wait for
    busy_s = dense * max(host_s, layer_weights_s) + sparse * sparse_busy_s
    return step_s, busy_s, int(sparse * partial_layer)


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
    """A stated profile by name, or the rates a probe measured (a JSON file written by scripts/gpu_probe.py,
    its `rates` over the h100 profile's); `h2d_gbps` replaces the pinned host-to-device rate."""
    if name.endswith(".json"):
        profile = _measured(Path(name))
    elif name in PROFILES:
        profile = PROFILES[name]
    else:
        raise ValueError(f"unknown device profile {name!r}: choose from {', '.join(PROFILES)} or a rates .json")
    return replace(profile, pinned_h2d_gbps=h2d_gbps) if h2d_gbps else profile


def _measured(path: Path) -> DeviceProfile:
    try:
        probe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read measured rates from {path}: {error}") from None
    known = {field.name for field in fields(DeviceProfile)} - {"name", "rates"}
    rates = {key: float(value) for key, value in probe.get("rates", {}).items() if key in known and value}
    if not rates:
        raise ValueError(f"{path} holds no rates (expected a 'rates' object from scripts/gpu_probe.py)")
    name = f"{probe.get('device', 'measured device')} (predicted from measured rates)"
    return replace(PROFILES["h100"], name=name, rates=str(path), **rates)
