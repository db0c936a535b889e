"""Alpha x budget x partial ratio for InfiniGen: perplexity against full and the share of KV fetched.

    python -m bench sweep --text essays/ --context 2048 --alphas 3,4,5,6 --budgets 0.1,0.2

Every combination scores the same windows through the decode path (see ppl.py); the prefix's K/V is
reused, only the partial keys are rebuilt when the partial ratio changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from infinigen_core import EngineConfig
from .ppl import perplexity


def sweep(engine, windows: Sequence[Sequence[int]], prefill: int, alphas: Sequence[float], budgets: Sequence[float],
          partial_ratios: Sequence[float], base: EngineConfig | None = None, progress=None) -> list[dict]:
    """One row per combination (plus the full cache as 'full'): alpha, budget, partial_ratio, ppl, ppl_vs_full, fetched_ratio."""
    base = base or EngineConfig()
    configs = {"full": base.with_changes(policy="full")}
    for alpha, budget, partial in itertools.product(alphas, budgets, partial_ratios):
        configs[f"a{alpha}-b{budget}-p{partial}"] = base.with_changes(
            policy="infinigen", alpha=float(alpha), budget=float(budget), partial_ratio=float(partial))
    results = perplexity(engine, windows, prefill, configs, progress)
    reference = results["full"]["ppl"]
    rows = []
    for name, config in configs.items():
        result = results[name]
        rows.append({"policy": config.policy, "alpha": config.alpha if name != "full" else None,
                     "budget": config.budget if name != "full" else None,
                     "partial_ratio": config.partial_ratio if name != "full" else None,
                     "ppl": result["ppl"], "ppl_vs_full": result["ppl"] / reference - 1.0,
                     "fetched_ratio": result["fetched_ratio"], "sparse_fetched_ratio": result["sparse_fetched_ratio"],
                     "ms_per_token": result["ms_per_token"]})
    return rows


def choose_defaults(rows: Sequence[dict], max_ppl_increase: float = 0.01) -> dict | None:
    """The InfiniGen row fetching the least KV whose perplexity is within `max_ppl_increase` of full's."""
    eligible = [r for r in rows if r["policy"] == "infinigen" and r["ppl_vs_full"] <= max_ppl_increase]
    return min(eligible, key=lambda r: (r["fetched_ratio"], r["ppl_vs_full"])) if eligible else None
