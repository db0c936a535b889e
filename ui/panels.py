"""Live panels as pictures: memory, fetched ratio per layer, sparsity over time, time split, context.

Each function takes plain numbers (read from the engine by `collect`) and returns a matplotlib figure,
so the panels can be tested and rendered without a browser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

MiB = 2**20


@dataclass
class PanelData:
    memory_mib: dict[str, float] = field(default_factory=dict)
    latest_ratio: list[float] = field(default_factory=list)  # per layer, latest decode step
    mean_ratio: list[float] = field(default_factory=list)  # per layer, over the recent decode steps
    sparsity: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [layers, steps] fetched ratio
    time_split_ms: dict[str, float] = field(default_factory=dict)  # mean per decode step
    tokens_per_second: float = 0.0
    context: int = 0
    window: int = 1
    policy: str = ""
    layer_kinds: list[str] = field(default_factory=list)  # per layer: "global", "sliding 512", "global, no RoPE"

    def sliding_layers(self) -> list[int]:
        return [layer for layer, kind in enumerate(self.layer_kinds) if kind.startswith("sliding")]


def memory_figures(engine) -> dict[str, float]:
    process, system = psutil.Process(), psutil.virtual_memory()
    pool = engine.pool
    figures = {
        "KV pool": pool.bytes_allocated() / MiB,
        "pinned host": (pool.bytes_allocated() if pool.pin_memory else 0) / MiB,
        "process RSS": process.memory_info().rss / MiB,
        "system available": system.available / MiB,
    }
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        figures.update({"GPU allocated": torch.cuda.memory_allocated() / MiB,
                        "GPU reserved": torch.cuda.memory_reserved() / MiB, "GPU free": free / MiB})
    return figures


def collect(engine, tokens_per_second: float = 0.0) -> PanelData:
    steps = engine.recent_decode_steps()
    layers = engine.adapter.num_layers
    data = PanelData(memory_mib=memory_figures(engine), tokens_per_second=tokens_per_second,
                     context=engine.num_tokens, window=engine.max_context, policy=engine.config.policy,
                     layer_kinds=[engine.adapter.layer_kind(layer) for layer in range(layers)])
    if not steps:
        return data
    matrix = np.ones((layers, len(steps)))
    for column, step in enumerate(steps):
        for layer in step.layers:
            matrix[layer.layer, column] = layer.fetched_ratio
    data.sparsity = matrix
    data.latest_ratio = matrix[:, -1].tolist()
    data.mean_ratio = matrix.mean(axis=1).tolist()
    splits = [s.time_split_ms() for s in steps]
    data.time_split_ms = {key: float(np.mean([split[key] for split in splits])) for key in splits[0]}
    return data


def _figure(width: float = 5.2, height: float = 2.6):
    figure, axis = plt.subplots(figsize=(width, height), dpi=90)
    return figure, axis


def memory_plot(data: PanelData):
    figure, axis = _figure()
    shown = {k: v for k, v in data.memory_mib.items() if k != "system available"}
    names, values = list(shown), list(shown.values())
    bars = axis.barh(names, values, color="#4c78a8")
    axis.bar_label(bars, labels=[f"{v:,.0f} MiB" for v in values], padding=3, fontsize=8)
    axis.set_xlabel("MiB")
    axis.set_title(f"Memory (system available: {data.memory_mib.get('system available', 0):,.0f} MiB)")
    axis.set_xlim(0, max(values + [1]) * 1.35)
    figure.tight_layout()
    return figure


def fetch_ratio_plot(data: PanelData):
    figure, axis = _figure()
    if data.latest_ratio:
        layers = np.arange(len(data.latest_ratio))
        sliding = set(data.sliding_layers())
        colours = ["#bab0ac" if layer in sliding else "#f58518" for layer in layers]
        axis.bar(layers, data.latest_ratio, color=colours, label="latest step")
        axis.plot(layers, data.mean_ratio, color="#222222", marker=".", label="running mean")
        if sliding:  # their whole window is read; InfiniGen selects on the global layers only
            axis.bar([], [], color="#bab0ac", label="sliding-window layer")
        axis.legend(fontsize=8, loc="upper right")
    else:
        axis.text(0.5, 0.5, "no decode step yet", ha="center", va="center", transform=axis.transAxes)
    axis.set_ylim(0, 1.05)
    axis.set_xlabel("layer")
    axis.set_ylabel("fetched / context")
    axis.set_title(f"Fetched-token ratio per layer ({data.policy})")
    figure.tight_layout()
    return figure


def sparsity_heatmap(data: PanelData):
    figure, axis = _figure()
    if data.sparsity.size:
        image = axis.imshow(data.sparsity, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1,
                            interpolation="nearest")
        figure.colorbar(image, ax=axis, label="fetched ratio")
    else:
        axis.text(0.5, 0.5, "no decode step yet", ha="center", va="center", transform=axis.transAxes)
    axis.set_xlabel("recent decode steps")
    axis.set_ylabel("layer")
    sliding = data.sliding_layers()
    if sliding and data.sparsity.size:
        axis.set_yticks(sliding, ["S"] * len(sliding), fontsize=6)
        axis.set_title("Per-layer sparsity over time (S: sliding-window layer)")
    else:
        axis.set_title("Per-layer sparsity over time")
    figure.tight_layout()
    return figure


def timing_plot(data: PanelData):
    figure, (time_axis, context_axis) = plt.subplots(2, 1, figsize=(5.2, 2.8), dpi=90,
                                                     gridspec_kw={"height_ratios": [2, 1]})
    split = data.time_split_ms
    if split:
        other = max(split["total"] - split["speculate"] - split["fetch_wait"] - split["attention"], 0.0)
        parts = {"speculate": split["speculate"], "fetch wait": split["fetch_wait"],
                 "attention": split["attention"], "rest of the model": other}
        left = 0.0
        for (name, value), colour in zip(parts.items(), ("#e45756", "#72b7b2", "#f58518", "#bab0ac")):
            time_axis.barh([0], [value], left=left, color=colour, label=f"{name} {value:.1f}")
            left += value
        time_axis.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(0, -0.25))
    time_axis.set_yticks([])
    time_axis.set_title(f"ms per decode step; {data.tokens_per_second:.1f} tokens/s")
    context_axis.barh([0], [data.window], color="#eeeeee")
    context_axis.barh([0], [data.context], color="#4c78a8")
    context_axis.set_yticks([])
    context_axis.set_xlim(0, data.window)
    context_axis.set_title(f"context {data.context:,} / {data.window:,} tokens", fontsize=9)
    figure.tight_layout()
    return figure


def close_all(*figures) -> None:
    for figure in figures:
        plt.close(figure)
