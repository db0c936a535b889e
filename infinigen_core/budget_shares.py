"""How a sparse policy's fetch budget is spread over the layers: more rows where attention is flat.

A layer whose attention is peaked loses little when it reads 5% of its rows; one whose attention is flat
loses much at 10%. At calibration, per layer, the share of the true attention mass that the best fraction f
of the past carries is recorded over a grid of fractions (`attention_curve`: the calibration text's last
queries, each KV head's query group summed, as InfiniGen's selection ranks rows). For a budget b, the
fractions f_l that maximise the mean covered mass subject to mean(f_l) = b are found by water-filling on
those curves (`layer_shares`), and each sparse layer then fetches f_l / b times the uniform budget.

    curve = attention_curve(queries, keys, group_size=3, scale=0.125)   # [len(CURVE_FRACTIONS)]
    shares = layer_shares({2: curve2, 3: curve3, ...}, budget=0.1)       # {layer: share}, mean 1
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

CURVE_FRACTIONS = tuple(round(0.01 * step, 2) for step in range(1, 51))  # 1% .. 50% of the past
CURVE_QUERIES = 256  # the calibration text's last queries, at most half of it
SHARE_STEP = 0.05  # shares move in steps of 5% of the budget
SHARE_LIMITS = (0.25, 4.0)  # no layer reads less than a quarter or more than four times the uniform budget


def attention_curve(queries: torch.Tensor, keys: torch.Tensor, group_size: int, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """queries [heads, T, dim], keys [kv_heads, T, dim] of one layer (causal, what its attention receives) ->
    [len(CURVE_FRACTIONS)]: per fraction f, the mean share of the attention mass on the past (the token's own
    row always attended) that each KV head's ceil(f * past) best past rows carry, ranked by the group's sum."""
    heads, length, dim = queries.shape
    kv_heads = keys.shape[0]
    count = min(CURVE_QUERIES, length // 2)
    if count < 1:
        return torch.ones(len(CURVE_FRACTIONS))
    positions = torch.arange(length - count, length)
    query = queries[:, length - count:].double().reshape(kv_heads, group_size, count, dim)
    logits = torch.einsum("kgqd,ktd->kgqt", query, keys.double()) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    columns = torch.arange(length)
    logits = logits.masked_fill(columns > positions[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    own = probs[..., length - count:].diagonal(dim1=-2, dim2=-1).mean(1)  # [kv, count]: the token's own row
    probs = probs.masked_fill(columns == positions[:, None], 0.0)
    ranked = (probs.sum(1) / group_size).sort(dim=-1, descending=True).values.cumsum(-1)  # [kv, count, T]
    points = []
    for fraction in CURVE_FRACTIONS:
        rows = (positions.double() * fraction - 1e-9).ceil().long().clamp(min=1) - 1  # [count], as the budget rounds
        covered = ranked.gather(-1, rows.view(1, count, 1).expand(kv_heads, count, 1)).squeeze(-1)
        points.append((covered + own).mean())
    return torch.stack(points).float()


def spread_for(config, curves, sparse_layers) -> dict[int, float]:
    """The shares under `config` (EngineConfig) for `sparse_layers` from the calibrated `curves` (SkewSet's
    attention_curves): {} (every layer uniform) for a token budget, with `budget_by_layer` off, or without curves."""
    if not config.budget_by_layer or config.budget_is_tokens or curves is None:
        return {}
    return layer_shares({layer: curves[layer] for layer in sparse_layers}, config.budget)


def layer_shares(curves: Mapping[int, torch.Tensor], budget: float) -> dict[int, float]:
    """Per layer of `curves`, the multiple of the uniform `budget` (a fraction of the past) it fetches; their
    mean is at most 1, so the layers together fetch no more than the uniform budget would."""
    layers = sorted(curves)
    if not layers:
        return {}
    grid = torch.tensor((0.0, *CURVE_FRACTIONS), dtype=torch.float64)
    low, high = SHARE_LIMITS
    steps = int(round((high - low) / SHARE_STEP))
    # per layer, the mass covered at each share from `low` to `high` (the curve read between its points)
    candidates = torch.linspace(low, high, steps + 1, dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    covered = torch.stack([_interpolate(grid, torch.cat([zero, curves[layer].double()]), candidates * budget)
                           for layer in layers])
    chosen = [0] * len(layers)
    spare = int(round((1.0 - low) / SHARE_STEP)) * len(layers)  # steps above `low` the mean allows
    gains = (covered[:, 1:] - covered[:, :-1]).tolist()  # [layers][steps]: what each next step of share buys
    for _ in range(spare):  # greedy: the curves are concave, so the best next step is the best allocation's
        best, best_gain = -1, -1.0
        for index, step in enumerate(chosen):  # on a tie (a straight curve), the layer with the smaller share
            if step < steps and (gains[index][step] > best_gain + 1e-12
                                 or (gains[index][step] > best_gain - 1e-12 and step < chosen[best])):
                best, best_gain = index, gains[index][step]
        if best < 0:
            break
        chosen[best] += 1
    return {layer: round(low + SHARE_STEP * step, 4) for layer, step in zip(layers, chosen)}


def _interpolate(grid: torch.Tensor, values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The piecewise-linear curve through (grid, values) at `at` (beyond the grid: its last value)."""
    at = at.clamp(max=float(grid[-1]))
    right = torch.searchsorted(grid, at).clamp(1, len(grid) - 1)
    left = right - 1
    span = grid[right] - grid[left]
    weight = (at - grid[left]) / span
    return values[left] + weight * (values[right] - values[left])
