"""The GPU table predicted for this code's design, to set beside a measured run.

    python -m bench gpu --predict --device-profile h100 --save docs/results/gpu-predicted.json
    python -m bench gpu --predict --device-profile docs/results/gpu-probe-h100.json   # measured rates

The bytes each policy moves per decode step are the engine's own count (`fetcher.bytes_fetched`, held to
it by tests/test_gpu_bench.py): the pool holds the new token when a layer is fetched, InfiniGen fetches
`EngineConfig.budget_tokens_for(context)` rows per KV head of each sparse layer; with
`dense_layers_on_device` (the default) its dense layers stay on the GPU and move nothing, and `offload`
keeps resident the whole layers that fit in the GPU memory InfiniGen's KV-side state takes (its dense layers,
partial keys and gather buffers: fetch.resident_layer_set, the fair baseline at equal memory).
Time per step, eager PyTorch (no CUDA graph: the CUDA step is not captured), per decoder layer:

- the host launches every layer's kernels (`host_ms_per_layer`); the GPU reads the layer's weights (and
  the KV of a layer kept on the GPU) from HBM; a layer is bound by the slower of the two;
- `offload` copies each layer it does not keep whole from pinned memory by DMA one layer ahead on a side
  stream: such a layer takes the longest of launch, compute and its copy; the first copied layer's copy
  hides only behind the layer before it;
- `hf-offload` (transformers' `DynamicCache(offloading=True)`) prefetches every layer the same way (pinned,
  non-blocking, on its own stream) and sends it back after use: as `offload` with nothing resident and the
  copy back on the other direction of the full-duplex link, but no first copy waits: its prefetch circles
  back, so the last layer's update starts layer 0's copy for the next step (`Cache.prefetch` in
  transformers' cache_utils.py);
- `infinigen`, zero-copy fetch (`EngineConfig.zero_copy_fetch`, the CUDA default; zero_copy.py): dense
  layers cost what `full`'s cost; a sparse layer's selected rows are gathered by the GPU straight from the
  pinned pool over PCIe (`zero_copy_gather_gbps`, a scattered read of one row per KV head and slot), on a
  side stream while the layer before computes; no host gather, no host round trip. A sparse layer takes the
  longest of its launches (+ speculation's, `sparse_extra_host_ms`), its HBM reads (weights, partial keys,
  rows) and its gather;
- `infinigen`, staged fetch (`zero_copy_fetch=False`, or a failed probe at load): the host waits per sparse
  layer for the GPU's indices (`round_trip_ms`) and gathers the rows into pinned staging
  (`host_gather_gbps`) before the copy up: both add to the layer's time.

Rates come from a profile (stated: vendor sheets and the audit's estimates) or from a measured-rates JSON
written by scripts/gpu_probe.py. The GPU cache of selected rows (`selected_rows_cache`) is off by default
and its hit rate unmeasured on real attention, so no row assumes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from infinigen_core.fetch import resident_layer_set

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
    zero_copy_gather_gbps: float  # the GPU gathering selected rows (256-byte rows) straight from pinned memory
    rates: str = "stated"  # or the measured-rates file they came from


PROFILES = {
    "h100": DeviceProfile("H100 SXM (predicted)", hbm_gbps=3350.0, pinned_h2d_gbps=50.0, pinned_d2h_gbps=50.0,
                          host_gather_gbps=25.0, host_ms_per_layer=0.6, sparse_extra_host_ms=0.3,
                          round_trip_ms=0.05, zero_copy_gather_gbps=25.0),
    "h200": DeviceProfile("H200 (predicted)", hbm_gbps=4800.0, pinned_h2d_gbps=50.0, pinned_d2h_gbps=50.0,
                          host_gather_gbps=25.0, host_ms_per_layer=0.6, sparse_extra_host_ms=0.3,
                          round_trip_ms=0.05, zero_copy_gather_gbps=25.0),
}
FP16_BYTES = 2
FETCHES = ("zero-copy", "staged")  # how InfiniGen's selected rows reach the GPU (EngineConfig.zero_copy_fetch)


def resident_layers(shape: ModelShape, policy: str, budget: float | None, context: int) -> int:
    """Layers whose KV stays on the GPU under the benchmark's settings (fetch.resident_layer_set, the engine's
    rule; Llama shapes: every layer global): InfiniGen's dense first layers; for `offload`, the fair baseline,
    the whole layers that fit in the GPU memory InfiniGen's KV-side state takes at `budget` (the benchmark
    runs offload under its first budget). The engine applies the rule over the model's window, the benchmark's
    context plus its decode steps: the same count unless a layer's worth of bytes falls in between."""
    if policy not in ("offload", "infinigen"):
        return 0
    if budget is None:
        raise ValueError(f"{policy} needs a budget (offload: the InfiniGen budget whose GPU memory it gets)")
    head_dim = shape.hidden // shape.heads
    return len(resident_layer_set(policy, [True] * shape.layers, bench_config(budget), head_dim, context))


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
        return (shape.layers - resident_layers(shape, policy, budget, context)) * held * per_token
    if policy != "infinigen":
        raise ValueError(f"no prediction for policy {policy!r}")
    if budget is None:
        raise ValueError("infinigen needs a budget")
    config = bench_config(budget)
    dense = min(config.dense_layers, shape.layers)
    rows = config.budget_tokens_for(context)
    dense_bytes = (dense - resident_layers(shape, policy, budget, context)) * held * per_token
    return dense_bytes + (shape.layers - dense) * rows * per_token


def predict_step(shape: ModelShape, context: int, policy: str, budget: float | None, profile: DeviceProfile,
                 element_bytes: int = FP16_BYTES, fetch: str = "zero-copy") -> dict:
    """One row in the measured table's shape: ms_per_token, bytes_fetched_per_token, fetch wait, memory;
    `fetch` (InfiniGen only): how its selected rows reach the GPU, one of FETCHES."""
    per_token = kv_bytes_per_token_layer(shape, element_bytes)
    layer_kv = (context + 1) * per_token
    weights = weight_bytes(shape, element_bytes)
    hbm = profile.hbm_gbps * 1e9
    layer_weights_s = weights / shape.layers / hbm
    host_s = profile.host_ms_per_layer / 1e3
    h2d_s, d2h_s = layer_kv / (profile.pinned_h2d_gbps * 1e9), layer_kv / (profile.pinned_d2h_gbps * 1e9)
    resident_s = max(host_s, layer_weights_s + layer_kv / hbm)  # a layer whose KV is on the GPU (`full`'s)
    fetched = fetched_bytes(shape, context, policy, budget, element_bytes)
    resident = resident_layers(shape, policy, budget, context)
    gpu_bytes = weights + resident * layer_kv
    if policy == "full":
        step_s = busy_s = shape.layers * resident_s
        gpu_bytes += shape.layers * layer_kv
    elif policy in ("offload", "hf-offload"):
        back_s = d2h_s if policy == "hf-offload" else 0.0
        copied = shape.layers - resident
        # offload's first copied layer hides only behind the layer before it; transformers' prefetch of layer 0
        # starts in the previous step's last layer, a copied layer that takes a whole copy's time: all hidden
        first_copy_s = 0.0 if policy == "hf-offload" else max(0.0, h2d_s - (resident_s if resident else 0.0))
        step_s = resident * resident_s + first_copy_s + copied * max(host_s, layer_weights_s, h2d_s, back_s)
        busy_s = resident * resident_s + copied * max(host_s, layer_weights_s)
        gpu_bytes += 2 * layer_kv  # two layers in flight
    else:
        if fetch not in FETCHES:
            raise ValueError(f"unknown fetch {fetch!r}: one of {', '.join(FETCHES)}")
        step_s, busy_s, partial_bytes = _infinigen_step(shape, context, budget, profile, element_bytes, fetch)
        gpu_bytes += partial_bytes
    ms = step_s * 1e3
    moved = fetched or (2 * shape.layers * layer_kv if policy == "hf-offload" else 0)
    return {"model": shape.name, "context": context, "policy": policy,
            "budget": budget if policy == "infinigen" else None, "fetch": fetch if policy == "infinigen" else None,
            "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "bytes_fetched_per_token": fetched,
            "fetch_wait_ms_per_step": (step_s - busy_s) * 1e3 if policy != "full" else None,
            "h2d_gbps": moved / step_s / 1e9 if moved else None, "peak_h2d_gbps": profile.pinned_h2d_gbps,
            "resident_layers": resident if policy != "full" else shape.layers, "peak_gpu_bytes": gpu_bytes}


def _infinigen_step(shape: ModelShape, context: int, budget: float | None, profile: DeviceProfile,
                    element_bytes: int, fetch: str) -> tuple[float, float, int]:
    """(step seconds, seconds the layers' own work takes, GPU bytes of the partial keys and gather buffers)."""
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
    if fetch == "zero-copy":  # the GPU's own gather over PCIe, one layer ahead on a side stream
        sparse_s = max(sparse_busy_s, rows_bytes / (profile.zero_copy_gather_gbps * 1e9))
        buffers = 2 * rows_bytes  # zero_copy.MappedRows: two gather buffers, used in turn
    else:  # the host waits for the indices and gathers before the copy up
        sparse_s = (max(sparse_busy_s, rows_bytes / (profile.pinned_h2d_gbps * 1e9)) + profile.round_trip_ms / 1e3
                    + rows_bytes / (profile.host_gather_gbps * 1e9))
        buffers = 0
    step_s = dense * dense_s + sparse * sparse_s  # the first layer is dense and resident: no copy to wait for
    busy_s = dense * dense_s + sparse * sparse_busy_s
    return step_s, busy_s, int(sparse * partial_layer + buffers)


def predict_table(shape_names: Sequence[str], contexts: Sequence[int], policies: Sequence[str],
                  budgets: Sequence[float], profile: DeviceProfile) -> dict:
    rows = []
    for shape_name in shape_names:
        for context in contexts:
            for policy in policies:
                # offload: the GPU memory of InfiniGen at the first budget, as the benchmark runs it
                for budget in (budgets if policy == "infinigen" else budgets[:1] if policy == "offload" else [None]):
                    for fetch in (FETCHES if policy == "infinigen" else FETCHES[:1]):
                        rows.append(predict_step(SHAPES[shape_name], context, policy, budget, profile, fetch=fetch))
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
