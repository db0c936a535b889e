"""InfiniGen spreads its budget over the sparse layers by how flat their attention was at calibration."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from infinigen_core.budget_shares import CURVE_FRACTIONS, SHARE_LIMITS, SHARE_STEP, attention_curve, layer_shares
from infinigen_core.config import EngineConfig
from infinigen_core.engine import InfiniGenEngine
from infinigen_core.skew import load_skew, save_skew

from conftest import hold_int8_partial_codes, make_tiny_engine, random_tokens

FRACTIONS = torch.tensor(CURVE_FRACTIONS, dtype=torch.float64)
FLAT = FRACTIONS.clone()  # uniform attention: the best f of the past carries f of the mass
PEAKED = 1.0 - 0.5 * torch.exp(-100.0 * FRACTIONS)  # half the mass on a few rows, the rest quickly covered


def test_uniform_attention_covers_its_share_of_rows_and_the_own_row():
    # zero queries attend uniformly: the best ceil(f * past) past rows and the own row carry (that + 1) / (past + 1)
    length, count = 600, 256
    curve = attention_curve(torch.zeros(4, length, 8), torch.randn(2, length, 8), group_size=2, scale=0.3)
    positions = torch.arange(length - count, length, dtype=torch.float64)
    for index, fraction in enumerate(CURVE_FRACTIONS):
        expected = (((positions * fraction - 1e-9).ceil() + 1) / (positions + 1)).mean()
        assert curve[index].item() == pytest.approx(expected.item(), abs=1e-5), fraction


def test_peaked_attention_covers_more_with_fewer_rows():
    torch.manual_seed(0)
    keys = torch.randn(1, 400, 16)
    flat = attention_curve(torch.randn(2, 400, 16) * 0.01, keys, group_size=2, scale=0.25)
    queries = keys[0, 7].expand(2, 400, 16) * 4.0  # every query points at one key: row 7 takes nearly all mass
    peaked = attention_curve(queries, keys, group_size=2, scale=0.25)
    assert torch.all(flat[1:] >= flat[:-1] - 1e-6) and torch.all(peaked[1:] >= peaked[:-1] - 1e-6)
    assert peaked[0] > 0.95 > 0.2 > flat[0]
    assert float(peaked[-1]) <= 1.0 + 1e-6


def test_a_flat_layer_gets_more_of_the_budget_and_the_mean_stays_the_budget():
    shares = layer_shares({2: PEAKED, 3: FLAT, 4: PEAKED}, budget=0.1)
    assert shares[3] > 1.0 > shares[2] == shares[4]
    assert sum(shares.values()) / 3 == pytest.approx(1.0, abs=1e-9)
    assert all(SHARE_LIMITS[0] - 1e-9 <= share <= SHARE_LIMITS[1] + 1e-9 for share in shares.values())
    assert layer_shares({2: FLAT, 3: FLAT}, budget=0.1) == pytest.approx({2: 1.0, 3: 1.0})


def _covered(curve: torch.Tensor, fraction: float) -> float:
    grid = [0.0, *CURVE_FRACTIONS]
    values = [0.0, *curve.tolist()]
    fraction = min(fraction, grid[-1])
    right = next(i for i, point in enumerate(grid) if point >= fraction - 1e-12)
    if right == 0:
        return values[0]
    left = right - 1
    return values[left] + (fraction - grid[left]) / (grid[right] - grid[left]) * (values[right] - values[left])


def test_the_shares_cover_the_most_mass_any_allocation_on_the_grid_covers():
    curves = {2: PEAKED, 3: FLAT ** 0.5, 4: 1.0 - (1.0 - FRACTIONS) ** 8}
    budget = 0.08
    shares = layer_shares(curves, budget)
    best = sum(_covered(curves[layer], share * budget) for layer, share in shares.items())
    low, high = SHARE_LIMITS
    grid = [low + SHARE_STEP * step for step in range(int(round((high - low) / SHARE_STEP)) + 1)]
    for first, second in itertools.product(grid, grid):
        third = 3.0 - first - second
        if low - 1e-9 <= third <= high + 1e-9:
            other = sum(_covered(curves[layer], share * budget) for layer, share in zip((2, 3, 4), (first, second, third)))
            assert other <= best + 1e-9, (first, second, third)


def _skewed_curves(tiny_llama, flat_layer: int):
    """tiny_llama with its attention curves replaced: `flat_layer` flat, the other sparse layer peaked."""
    model, skew = tiny_llama
    curves = tuple((FLAT if layer == flat_layer else PEAKED).float() for layer in range(len(skew.skews)))
    return model, dataclasses.replace(skew, attention_curves=curves)


@pytest.mark.parametrize("flat_layer", [2, 3])
def test_each_sparse_layer_fetches_its_share_and_together_no_more_than_the_budget(tiny_llama, kernels, flat_layer):
    model, skew = _skewed_curves(tiny_llama, flat_layer)
    settings = dict(policy="infinigen", budget=0.2, alpha=1e9, min_fetch_tokens=0, budget_by_head=False)  # k per head
    fetched, coded = {}, False
    for name, with_kernels in (("kernels", kernels), ("eager", None)):
        engine = InfiniGenEngine(model, None, EngineConfig(**settings), skew_set=skew, fingerprint="tiny",
                                 kernels=with_kernels)
        coded = coded or engine.policy.coded
        if with_kernels is None and coded:
            hold_int8_partial_codes(engine)  # the kernels' int8 partial keys, scored as they score them
        shares = engine.policy.budget_shares
        assert shares[flat_layer] > 1.0 > shares[5 - flat_layer]
        engine.prefill(random_tokens(200, seed=11))
        engine.score(random_tokens(3, seed=12))
        for step in (s for s in engine.history if s.is_decode):
            for layer in step.sparse_layers():
                uniform = math.ceil(0.2 * layer.context_len)
                assert layer.fetched == int(shares[layer.layer] * uniform + 1e-9)
                assert layer.selected_positions.shape[1] == layer.fetched
            assert sum(layer.fetched for layer in step.sparse_layers()) <= 2 * uniform
        fetched[name] = [(layer.layer, {frozenset(head.tolist()) for head in layer.selected_positions})
                         for layer in engine.history[-1].sparse_layers()]
        engine.close()
    assert fetched["eager"] == fetched["kernels"]  # the CPU kernels pick the same rows as the eager ops


def test_uniform_when_turned_off_or_for_a_token_budget(tiny_llama):
    model, skew = _skewed_curves(tiny_llama, 2)
    for settings in (dict(budget=0.2, budget_by_layer=False), dict(budget=30, budget_is_tokens=True)):
        engine = InfiniGenEngine(model, None, EngineConfig(policy="infinigen", min_fetch_tokens=0, alpha=1e9, **settings),
                                 skew_set=skew, fingerprint="tiny")
        assert engine.policy.budget_shares == {}
        engine.prefill(random_tokens(200, seed=11))
        engine.decode(5)
        counts = {layer.fetched for layer in engine.history[-1].sparse_layers()}
        assert counts == {engine.config.budget_tokens_for(200)}
        engine.close()


@pytest.mark.filterwarnings("error")  # an out buffer too small for a layer's rows is resized with a warning
def test_across_devices_the_fetch_buffers_hold_the_largest_share(tiny_llama, separate_devices):
    model, skew = _skewed_curves(tiny_llama, 2)
    engine = InfiniGenEngine(model, None, EngineConfig(policy="infinigen", budget=0.2, alpha=1e9, min_fetch_tokens=0),
                             skew_set=skew, fingerprint="tiny")
    assert engine.work.rehearses_ahead
    engine.prefill(random_tokens(1000, seed=11))  # near the model's window: the uniform budget's buffers are too small
    assert engine.decode(5).isfinite().all()
    layers = {layer.layer: layer.fetched for layer in engine.history[-1].sparse_layers()}
    assert layers[2] > math.ceil(0.2 * engine.max_context) > layers[3]
    engine.close()


def test_calibration_records_a_curve_per_layer_and_the_cache_keeps_it(tmp_path, tiny_llama):
    _, skew = tiny_llama
    assert skew.attention_curves is not None and len(skew.attention_curves) == len(skew.skews)
    assert all(curve.shape == (len(CURVE_FRACTIONS),) for curve in skew.attention_curves)
    path = tmp_path / "skew.safetensors"
    save_skew(path, skew, {"fingerprint": "tiny"})
    loaded = load_skew(path, len(skew.skews))
    for saved, kept in zip(skew.attention_curves, loaded.attention_curves):
        torch.testing.assert_close(saved, kept)
    save_skew(path, dataclasses.replace(skew, attention_curves=None), {"fingerprint": "tiny"})
    assert load_skew(path, len(skew.skews)) is None  # a cache from before the curves: calibrated again


def test_make_tiny_engine_spreads_the_calibrated_budget(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.1) as engine:
        shares = engine.policy.budget_shares
    assert sorted(shares) == [2, 3] and sum(shares.values()) == pytest.approx(2.0)
