"""PNG plots of saved benchmark results (the files written with --save), for docs/BENCHMARKS.md.

    python -m bench plot --results results/ --out docs/plots

Reads whichever of ppl*.json, agree.json, recall.json, speed.json, sweep.json are present.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

POLICY_ORDER = ["full", "offload", "infinigen", "h2o", "streaming", "transformers", "hf-offload"]


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _policies(result: dict) -> list[str]:
    return [p for p in POLICY_ORDER if isinstance(result.get(p), dict)]



def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

def plot_ppl(results: list[dict], out: Path) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    contexts = [r["context"] for r in results]
    policies = [p for p in POLICY_ORDER if any(p in r for r in results) and p != "full"]
    width = 0.8 / max(len(policies), 1)
    for i, policy in enumerate(policies):
        xs = [c + (i - len(policies) / 2 + 0.5) * width for c in range(len(results))]
        left.bar(xs, [100 * r[policy]["ppl_vs_full"] if policy in r else 0 for r in results], width, label=policy)
        right.bar(xs, [100 * r[policy]["fetched_ratio"] if policy in r else 0 for r in results], width, label=policy)
    for axis, label in ((left, "perplexity vs full (%)"), (right, "KV fetched per step, all layers (%)")):
        axis.set_xticks(range(len(results)), [str(c) for c in contexts])
        axis.set_xlabel("context (tokens)")
        axis.set_ylabel(label)
        axis.axhline(0, color="black", linewidth=0.5)
        axis.grid(axis="y", alpha=0.3)
    left.set_yscale("symlog", linthresh=5)
    left.set_ylim(top=left.get_ylim()[1] * 4)  # room for the legend above the bars
    left.legend(loc="upper left", ncols=3, fontsize=8)
    return _save(figure, out / "ppl.png")


def plot_recall(result: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(8, 4))
    for policy in _policies(result):
        per_layer = {int(k): v for k, v in result[policy]["per_layer"].items()}
        layers = sorted(per_layer)
        axis.plot(layers, [per_layer[l] for l in layers], marker="o", markersize=3,
                  label=f"{policy} (fetches {100 * result[policy]['sparse_fetched_ratio']:.0f}%)")
    axis.set_xlabel("layer")
    axis.set_ylabel("true attention mass covered")
    axis.set_ylim(0, 1.02)
    axis.set_title(f"attention recall per layer, context {result['context']}")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, out / "recall.png")


def plot_speed(result: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4))
    rows = result["rows"]
    for policy in POLICY_ORDER:
        points = sorted((r["context"], r["ms_per_token"]) for r in rows if r["policy"] == policy)
        if points:
            axis.plot(*zip(*points), marker="o", label=policy, linestyle="--" if policy in ("transformers", "hf-offload") else "-")
    axis.set_xlabel("context (tokens)")
    axis.set_ylabel("decode ms per token (median)")
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title("CPU decode time per token")
    return _save(figure, out / "speed.png")


def plot_sweep(result: dict, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(8, 5))
    rows = [r for r in result["rows"] if r["policy"] == "infinigen"]
    for partial in sorted({r["partial_ratio"] for r in rows}):
        chosen = [r for r in rows if r["partial_ratio"] == partial]
        axis.scatter([100 * r["fetched_ratio"] for r in chosen], [100 * r["ppl_vs_full"] for r in chosen],
                     label=f"partial ratio {partial}")
        # combinations where the budget binds land on the same point: one label naming them all
        labels: dict[tuple[float, float], list[str]] = {}
        for r in chosen:
            point = (round(100 * r["fetched_ratio"], 1), round(100 * r["ppl_vs_full"], 1))
            labels.setdefault(point, []).append(f"a{r['alpha']:g}")
        for (x, y), names in labels.items():
            budget = next(r["budget"] for r in chosen if round(100 * r["fetched_ratio"], 1) == x)
            axis.annotate(f"{','.join(names)} b{budget:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if result.get("chosen"):
        c = result["chosen"]
        axis.scatter([100 * c["fetched_ratio"]], [100 * c["ppl_vs_full"]], s=160, facecolors="none",
                     edgecolors="red", label="chosen")
    axis.axhline(0, color="black", linewidth=0.5)
    axis.set_xlabel("KV fetched per step, all layers (%)")
    axis.set_ylabel("perplexity vs full (%)")
    axis.set_title(f"InfiniGen sweep, context {result['context']}")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, out / "sweep.png")


def make_plots(results_dir: str | Path, out_dir: str | Path) -> list[Path]:
    results_dir, out = Path(results_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    ppl = sorted((r for r in (_load(p) for p in results_dir.glob("ppl*.json")) if r), key=lambda r: r["context"])
    if ppl:
        made.append(plot_ppl(ppl, out))
    for name, plotter in (("recall", plot_recall), ("speed", plot_speed), ("sweep", plot_sweep)):
        result = _load(results_dir / f"{name}.json")
        if result:
            made.append(plotter(result, out))
    return made
