"""With nothing left out (budget 100%, alpha huge), every policy must compute exactly what `full` does."""

import pytest
import torch

from infinigen_core.config import EngineConfig

from conftest import make_tiny_engine, random_tokens

PROMPT, CONTINUATION = random_tokens(96, seed=3), random_tokens(12, seed=4)


def teacher_forced_logits(engine) -> torch.Tensor:
    first = engine.prefill(PROMPT)
    return torch.cat([first.unsqueeze(0), engine.score(CONTINUATION)])


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("policy", ["offload", "infinigen", "h2o", "streaming"])
def test_full_budget_matches_dense(request, model_fixture, policy):
    model_and_skew = request.getfixturevalue(model_fixture)
    dense = make_tiny_engine(model_and_skew, policy="full", prefill_chunk=40)
    # a budget covering the context attends densely (tests/test_decode_step.py); here the selecting path
    # itself must be exact when it selects every row
    sparse = make_tiny_engine(model_and_skew, policy=policy, budget=1.0, alpha=1e9, prefill_chunk=40,
                              dense_under_budget=False)
    try:
        expected, actual = teacher_forced_logits(dense), teacher_forced_logits(sparse)
        decode_steps = [s for s in sparse.history if s.is_decode]
        assert decode_steps and all(s.fetched_ratio() == 1.0 for s in decode_steps)
        if policy != "offload":
            assert any(layer.sparse for layer in decode_steps[-1].layers), "the sparse path must actually run"
    finally:
        dense.close(), sparse.close()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_a_small_budget_changes_the_logits(tiny_llama):
    """The converse: the comparison above would notice if tokens were really left out."""
    dense = make_tiny_engine(tiny_llama, policy="full")
    sparse = make_tiny_engine(tiny_llama, policy="infinigen", budget=0.05)
    try:
        difference = (teacher_forced_logits(dense) - teacher_forced_logits(sparse)).abs().max()
    finally:
        dense.close(), sparse.close()
    assert difference > 1e-3


def test_the_fetch_floor_makes_a_short_context_exact(tiny_llama):
    """A 5% budget left out tokens above; with a floor above the context length nothing is left out."""
    dense = make_tiny_engine(tiny_llama, policy="full")
    floored = make_tiny_engine(tiny_llama, policy="infinigen", budget=0.05, alpha=1e9, min_fetch_tokens=256)
    try:
        expected, actual = teacher_forced_logits(dense), teacher_forced_logits(floored)
        decode_steps = [s for s in floored.history if s.is_decode]
        assert all(layer.fetched == layer.context_len for s in decode_steps for layer in s.sparse_layers())
    finally:
        dense.close(), floored.close()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_real_model_full_budget_matches_dense(real_engine):
    from infinigen_core.calibration import calibration_text

    ids = real_engine.tokenizer(calibration_text())["input_ids"][:300]
    prompt, continuation = ids[:280], ids[280:]
    real_engine.configure(EngineConfig(policy="full"))
    expected = real_engine.prefill(prompt), real_engine.score(continuation)
    real_engine.reset()
    real_engine.configure(EngineConfig(policy="infinigen", budget=1.0, alpha=1e9))
    actual = real_engine.prefill(prompt), real_engine.score(continuation)
    assert real_engine.history[-1].fetched_ratio() == 1.0
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=1e-4)
