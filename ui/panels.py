"""Live panels that the browser draws: memory, fetched ratio per layer, sparsity over time, time split and
context.

`collect` reads plain numbers from the engine; `panel_views` turns them into one small view per panel: a pandas
DataFrame, which Gradio's native plots (`gr.BarPlot`, `gr.LinePlot`) send as JSON and draw with Vega, and for
the sparsity heat map a PNG of one pixel per layer and step inside a little HTML (`gr.HTML`). On the 2-core
machine, matplotlib drawing four figures a second on the server took most of a core from the model; a heat
map of 1,920 Vega points cost the browser, which shares those cores, about 0.04 of one at every update and
every status message of any event (Gradio's frontend copies each component's value then); a PNG of the same
cells is one short string.

    data = collect(engine, tokens_per_second)
    views = panel_views(data)    # {"memory": (frame, caption), "fetch": ..., "sparsity": (html, caption), ...}
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import psutil
import torch
from PIL import Image

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
    windows: list[int | None] = field(default_factory=list)  # per layer: its sliding window, None for a global one
    selecting: list[bool] = field(default_factory=list)  # per layer: the policy selected its rows at the latest step
    dense_reason: str | None = None  # why the latest step's sparse layers attended densely (a short chat)

    def sliding_layers(self) -> list[int]:
        return [layer for layer, kind in enumerate(self.layer_kinds) if kind.startswith("sliding")]

    def global_layers(self) -> list[int]:
        sliding = set(self.sliding_layers())
        return [layer for layer in range(len(self.layer_kinds)) if layer not in sliding]


def layer_ranges(layers: list[int]) -> str:
    """'0-4, 6-10, 12, 13' for [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13]: a caption's list of layers, short."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(", ".join(map(str, run)) if len(run) < 3 else f"{run[0]}-{run[-1]}" for run in runs)


def windows_text(windows) -> str:
    """'512' for one window size, '512 or 4,096' where the sliding layers differ."""
    return " or ".join(f"{window:,}" for window in sorted({window for window in windows if window is not None}))


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
    adapter = engine.adapter
    data = PanelData(memory_mib=memory_figures(engine), tokens_per_second=tokens_per_second,
                     context=engine.num_tokens, window=engine.max_context, policy=engine.config.policy,
                     layer_kinds=[adapter.layer_kind(layer) for layer in range(layers)],
                     windows=[adapter.sliding_window(layer) for layer in range(layers)])
    if not steps:
        return data
    matrix = np.ones((layers, len(steps)))
    for column, step in enumerate(steps):
        for layer in step.layers:
            matrix[layer.layer, column] = layer.fetched_ratio
    data.sparsity = matrix
    data.dense_reason = steps[-1].dense_reason
    sparse = {layer.layer for layer in steps[-1].layers if layer.sparse}
    data.selecting = [layer in sparse for layer in range(layers)]
    data.latest_ratio = matrix[:, -1].tolist()
    data.mean_ratio = matrix.mean(axis=1).tolist()
    splits = [s.time_split_ms() for s in steps]
    data.time_split_ms = {key: float(np.mean([split[key] for split in splits])) for key in splits[0]}
    return data


PANELS = ("memory", "fetch", "sparsity", "timing")  # the page's plots, in the order the tick sends them
# what the tick sends while a reply is generated: the heat map, an image the browser only scales (~1 ms). The
# Vega plots follow the turn: each redraw compiles its chart again, ~30 ms of the cores the model decodes on
LIVE_WHILE_GENERATING = ("sparsity",)
SPLIT_PARTS = {"speculate": "speculate", "fetch wait": "fetch_wait", "attention": "attention"}
REST = "rest of the model"
Table = tuple[pd.DataFrame, str]  # a plot's data and the caption under it
View = tuple[pd.DataFrame | str, str]  # a plot's data, or a panel's HTML, and its caption


def memory_table(data: PanelData) -> Table:
    """One bar per memory figure in whole MiB (so a few KiB of drift is no change); the system's available
    memory, larger than all of them, goes in the caption."""
    shown = {name: round(value) for name, value in data.memory_mib.items() if name != "system available"}
    frame = pd.DataFrame({"memory": list(shown), "MiB": list(shown.values())})
    return frame, f"system available: {data.memory_mib.get('system available', 0):,.0f} MiB"


SLIDING_SERIES = "sliding window / context"


def fetch_table(data: PanelData) -> Table:
    """Per layer, the fetched share of the context at the latest decode step and its mean over the recent
    steps: two series of one line plot, the layer's kind in the tooltip. A sliding-window layer reads its
    window, not a selection: its own series (the latest step), apart from the global layers', and the caption
    says what each kind read. Before the first decode step, every layer at 0 (an empty table makes Vega write
    NaN and -Infinity on the axis and in the legend)."""
    layers = len(data.latest_ratio)
    latest, mean = data.latest_ratio, data.mean_ratio
    if not layers:
        layers = len(data.layer_kinds)
        latest = mean = [0.0] * layers
    kinds = (data.layer_kinds or ["global"] * layers)[:layers]
    sliding = set(data.sliding_layers())
    rows = [(layer, latest[layer], "latest step") for layer in range(layers) if layer not in sliding]
    rows += [(layer, mean[layer], "running mean") for layer in range(layers) if layer not in sliding]
    rows += [(layer, latest[layer], SLIDING_SERIES) for layer in range(layers) if layer in sliding]
    frame = pd.DataFrame({"layer": [row[0] for row in rows],
                          "fetched / context": [round(row[1], 4) for row in rows],
                          "series": [row[2] for row in rows],
                          "kind": [kinds[row[0]] for row in rows]})
    stepped = bool(data.latest_ratio)
    caption = f"policy {data.policy}" if stepped else "no decode step yet"
    if data.dense_reason and stepped:  # the budget covers every token: nothing to select yet
        caption += f"; {data.dense_reason}"
    if sliding and stepped:
        caption += "; " + kinds_apart(data)
    return frame, caption


def kinds_apart(data: PanelData) -> str:
    """What the global layers and the sliding-window layers read at the latest step, said apart: the first
    select (under a sparse policy), the others read their whole window, whatever the policy."""
    sliding, global_ = data.sliding_layers(), data.global_layers()
    window = windows_text(data.windows[layer] for layer in sliding) if data.windows else ""
    share = sum(data.latest_ratio[layer] for layer in sliding) / len(sliding)
    reads = f"their last {window} tokens" if window else "their window"
    said = (f"sliding-window layers {layer_ranges(sliding)}: read {reads}, {100 * share:.1f}% of the context "
            f"(a window, not a selection)")
    selecting = [layer for layer in global_ if data.selecting and data.selecting[layer]]
    reading_all = [layer for layer in global_ if layer not in selecting]
    if reading_all:
        said = f"global layers {layer_ranges(reading_all)}: read the whole context; " + said
    if selecting:
        fetched = sum(data.latest_ratio[layer] for layer in selecting) / len(selecting)
        said = (f"global layers {layer_ranges(selecting)}: a selection, {100 * fetched:.1f}% of the context "
                f"fetched; " + said)
    return said


SPARSITY_TITLE = "Per-layer sparsity over time (fetched ratio)"
# the heat map's colours from sparse (0: nothing fetched) to dense (1: every token), evenly spaced anchors
HEAT_COLOURS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=float)


def heat_colours(values: np.ndarray) -> np.ndarray:
    """[..., 3] uint8 RGB of values in [0, 1] (clipped), interpolated between the anchors."""
    position = np.clip(values, 0.0, 1.0) * (len(HEAT_COLOURS) - 1)
    low = np.minimum(np.floor(position).astype(int), len(HEAT_COLOURS) - 2)
    share = (position - low)[..., None]
    return np.rint(HEAT_COLOURS[low] * (1 - share) + HEAT_COLOURS[low + 1] * share).astype(np.uint8)


# a sliding-window layer's row, in greys from dark (its window a small share of the context) to light (the
# whole context still fits its window): its ratio is the window over the context, not a selection
SLIDING_GREYS = np.array([[72, 72, 72], [224, 224, 224]], dtype=float)


def heat_rows(data: PanelData) -> np.ndarray:
    """[layers, steps, 3] uint8: the heat colours, the sliding-window layers' rows in greys."""
    rgb = heat_colours(data.sparsity)
    sliding = data.sliding_layers()
    if sliding:
        share = np.clip(data.sparsity[sliding], 0.0, 1.0)[..., None]
        rgb[sliding] = np.rint(SLIDING_GREYS[0] * (1 - share) + SLIDING_GREYS[1] * share).astype(np.uint8)
    return rgb


def png(rgb: np.ndarray) -> bytes:
    """A [height, width, 3] uint8 image as PNG bytes (Pillow, which Gradio and matplotlib already bring)."""
    encoded = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8), "RGB").save(encoded, format="PNG")
    return encoded.getvalue()


def sparsity_view(data: PanelData) -> View:
    """The fetched ratio of every layer (rows, layer 0 on top) at every recent decode step (columns, oldest on
    the left) as a heat map: a PNG of one pixel per cell that the browser scales up, with its axes and legend."""
    layers, steps = data.sparsity.shape
    sliding = data.sliding_layers()
    caption = "recent decode steps, oldest first" if steps else "no decode step yet"
    if sliding and steps:
        caption += (f"; sliding-window layers, in grey (their window over the context, not a selection): "
                    f"{layer_ranges(sliding)}")
    title = f'<div class="ig-heat-title">{SPARSITY_TITLE}</div>'
    if not steps:
        return f'<div class="ig-heat">{title}<p class="ig-heat-caption">{html.escape(caption)}</p></div>', caption
    image = base64.b64encode(png(heat_rows(data))).decode()
    gradient = ", ".join(f"rgb({r:.0f},{g:.0f},{b:.0f})" for r, g, b in HEAT_COLOURS)
    greys = ", ".join(f"rgb({r:.0f},{g:.0f},{b:.0f})" for r, g, b in SLIDING_GREYS)
    grey_legend = (f'<span class="ig-heat-bar" style="background: linear-gradient(to right, {greys})"></span>'
                   f'<span>sliding window</span>') if sliding else ""
    view = (
        f'<div class="ig-heat">{title}'
        f'<div class="ig-heat-map"><div class="ig-heat-y"><span>layer 0</span><span>layer {layers - 1}</span></div>'
        f'<img alt="fetched ratio of {layers} layers over the last {steps} decode steps" '
        f'src="data:image/png;base64,{image}"></div>'
        f'<div class="ig-heat-x"><span>step 0 (oldest)</span><span>step {steps - 1}</span></div>'
        f'<div class="ig-heat-legend"><span>0 fetched</span><span class="ig-heat-bar" '
        f'style="background: linear-gradient(to right, {gradient})"></span><span>all (1.0)</span>{grey_legend}</div>'
        f'<p class="ig-heat-caption">{html.escape(caption)}</p></div>'
    )
    return view, caption


def timing_table(data: PanelData) -> Table:
    """Where a decode step's time goes (mean ms of the recent steps); speed and context in the caption. Before
    the first decode step, every part at 0 ms (an empty table makes Vega write NaN and -Infinity)."""
    split = data.time_split_ms
    if split:
        parts = {name: split[key] for name, key in SPLIT_PARTS.items()}
        parts[REST] = max(split["total"] - sum(parts.values()), 0.0)
    else:
        parts = dict.fromkeys([*SPLIT_PARTS, REST], 0.0)
    frame = pd.DataFrame({"part": list(parts), "ms per decode step": [round(v, 2) for v in parts.values()]})
    speed = f"{data.tokens_per_second:.1f} tokens/s" if split else "no decode step yet"
    caption = f"{speed}; context {data.context:,} / {data.window:,} tokens"
    return frame, caption


def panel_views(data: PanelData) -> dict[str, View]:
    return {"memory": memory_table(data), "fetch": fetch_table(data), "sparsity": sparsity_view(data),
            "timing": timing_table(data)}


def digest(view: View) -> str:
    """What the page was last sent, in a few bytes: equal digests, nothing to send."""
    value, caption = view
    content = value if isinstance(value, str) else value.to_json(orient="split")
    return hashlib.blake2b(content.encode() + b"\0" + caption.encode(), digest_size=12).hexdigest()
