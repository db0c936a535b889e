"""Every policy attends to at most its budget, and to the tokens its rule names."""

import math

import pytest

from conftest import make_tiny_engine, random_tokens

CONTEXT = 200


def decode_some(engine, steps=4):
    engine.prefill(random_tokens(CONTEXT, seed=11))
    engine.score(random_tokens(steps, seed=12))
    return [s for s in engine.history if s.is_decode]


@pytest.mark.parametrize("policy", ["infinigen", "h2o", "streaming"])
@pytest.mark.parametrize("budget,is_tokens", [(0.1, False), (16, True)])
def test_sparse_policies_stay_within_budget(tiny_llama, policy, budget, is_tokens):
    with make_tiny_engine(tiny_llama, policy=policy, budget=budget, budget_is_tokens=is_tokens, alpha=1e9) as engine:
        steps = decode_some(engine)
        shares = getattr(engine.policy, "budget_shares", {})  # InfiniGen spreads a fractional budget over layers
    for step in steps:
        for layer in step.layers:
            uniform = int(budget) if is_tokens else math.ceil(budget * layer.context_len)
            cap = int(shares.get(layer.layer, 1.0) * uniform + 1e-9)
            if layer.layer < 2:
                assert not layer.sparse and layer.fetched == layer.context_len
            else:
                assert layer.sparse and layer.fetched == cap  # alpha is huge: the budget is what binds
                assert layer.selected_positions.max() < step.position  # only past tokens
        assert sum(layer.fetched for layer in step.sparse_layers()) <= 2 * uniform  # no more than the budget


def test_infinigen_fetches_fewer_than_the_budget_when_attention_is_peaked(tiny_llama):
    # random weights: flat attention; a budget under the whole context (one covering it attends densely)
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.9, alpha=0.002) as engine:
        steps = decode_some(engine)
    layer = steps[-1].layers[-1]
    # k rows are fetched (the budget: a length the host knows); attention keeps the alpha count of them
    assert layer.fetched == engine.policy.budget_for(layer.layer, layer.context_len) < layer.context_len
    assert layer.attended == max(1, math.ceil(layer.alpha_count)) < layer.fetched


def test_streaming_keeps_sinks_and_the_most_recent(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="streaming", budget=20, budget_is_tokens=True, sink_tokens=4) as engine:
        step = decode_some(engine, steps=1)[-1]
    expected = set(range(4)) | set(range(step.position - 16, step.position))
    for layer in step.sparse_layers():
        for head in layer.selected_positions:
            assert set(head.tolist()) == expected


def test_h2o_keeps_the_recent_half_and_heavy_hitters(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="h2o", budget=20, budget_is_tokens=True) as engine:
        step = decode_some(engine, steps=3)[-1]
        scores = [engine.policy.scores[layer.layer] for layer in step.sparse_layers()]
    for layer, layer_scores in zip(step.sparse_layers(), scores):
        for head, positions in enumerate(layer.selected_positions.tolist()):
            recent = set(range(step.position - 10, step.position))
            assert recent <= set(positions)
            heavy = [p for p in positions if p not in recent]
            assert len(heavy) == 10
            older = layer_scores[head, : step.position - 10]
            assert min(older[heavy].tolist()) >= older.topk(10).values.min().item() - 1e-6


def test_dense_policies_fetch_everything(tiny_llama):
    for policy in ("full", "offload"):
        with make_tiny_engine(tiny_llama, policy=policy) as engine:
            steps = decode_some(engine, steps=2)
        assert all(layer.fetched == layer.context_len for step in steps for layer in step.layers)
        assert all(step.fetched_ratio() == 1.0 for step in steps)


def test_recent_decode_steps_is_a_snapshot_of_the_decode_steps(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.2) as engine:
        engine.prefill(random_tokens(60, seed=5))
        for token in random_tokens(3, seed=6):
            engine.decode(token)
        steps = engine.recent_decode_steps()
        assert [s.is_decode for s in steps] == [True] * 3 and len(engine.history) == 4  # the prefill left out
        engine.decode(7)
        assert len(steps) == 3 and len(engine.recent_decode_steps()) == 4  # a copy, not a live view
