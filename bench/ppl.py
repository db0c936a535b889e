"""Perplexity of long text through the chat decode path, per policy.

    python -m bench ppl --text essays/ --context 4096 --policies full,infinigen,h2o,streaming

Each window of `context` tokens: the first `prefill` are prefilled (dense, as a chat prompt is), the
rest are fed one decode step at a time, so every scored token is predicted by the real cache and the
policy's real selection. The prefix's K/V is shared by the policies that do not learn from prefill.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from infinigen_core import EngineConfig
from .common import EvalError, decode_tokens, load_prefix, mean_nll


def default_prefill(context: int) -> int:
    """Score the last quarter of the window, at most 256 tokens (decode steps are the slow part)."""
    return context - min(256, max(context // 4, 2))


def check_scoring_windows(windows: Sequence[Sequence[int]], prefill: int) -> None:
    """Raise EvalError unless there are windows and `prefill` leaves at least 2 tokens of each to score."""
    if not windows:
        raise EvalError("no text windows to score")
    if not 1 <= prefill <= len(windows[0]) - 2:
        raise EvalError(f"prefill must leave at least 2 of the {len(windows[0])} tokens to score, got {prefill}")


def perplexity(engine, windows: Sequence[Sequence[int]], prefill: int, configs: dict[str, EngineConfig],
               progress=None) -> dict[str, dict]:
    """Per named config: ppl, fetched_ratio (all layers), sparse_fetched_ratio, ms_per_token over all windows."""
    check_scoring_windows(windows, prefill)
    totals = {name: {"nll": 0.0, "count": 0, "fetched": [], "sparse": [], "ms": []} for name in configs}
    for index, window in enumerate(windows):
        prefix, rest = list(window[:prefill]), list(window[prefill:])
        for name, config in configs.items():
            if progress:
                progress(f"window {index + 1}/{len(windows)}: {name} ({len(rest) - 1} decode steps)")
            load_prefix(engine, config, prefix)
            run = decode_tokens(engine, rest[:-1])  # the last token only needs to be predicted
            nll, count = mean_nll(run.logits, rest[1:])
            total = totals[name]
            total["nll"] += nll
            total["count"] += count
            total["fetched"] += run.fetched_ratios
            total["sparse"] += run.sparse_fetched_ratios
            total["ms"] += run.step_ms
    engine.reset()
    return {
        name: {
            "ppl": math.exp(t["nll"] / t["count"]),
            "fetched_ratio": statistics.fmean(t["fetched"]),
            "sparse_fetched_ratio": statistics.fmean(t["sparse"]),
            "ms_per_token": statistics.fmean(t["ms"]),
            "scored_tokens": t["count"],
        }
        for name, t in totals.items()
    }


def with_ratio_to_full(results: dict[str, dict]) -> dict[str, dict]:
    """Adds ppl_vs_full (relative change, +0.01 = 1% worse) when a 'full' row exists."""
    if "full" in results:
        base = results["full"]["ppl"]
        for row in results.values():
            row["ppl_vs_full"] = row["ppl"] / base - 1.0
    return results
