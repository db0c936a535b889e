"""The decode lane (decode_lane.py, kernels/decode_lane.cpp): a one-token step's attention in C++ from layer to
layer gives the Python path's logits to the bit, and the same statistics, selections and partial keys.

Each test decodes the same tokens twice with the same settings: once with the lane refused (the Python path,
step.py, the reference) and once with it, counting the steps the lane really ran."""

from __future__ import annotations

import pytest
import torch
from test_gemma_decode import tiny_gemma

from infinigen_core import decode_lane
from infinigen_core.compiled import compile_decode
from infinigen_core.config import EngineConfig
from infinigen_core.decode_lane import DecodeLane, lane_refusal
from infinigen_core.policies import partial_codes
from infinigen_core.policies.infinigen import stored_partial

from conftest import greedy_logits, make_tiny_engine, random_tokens

SELECTING = dict(policy="infinigen", budget=0.2, alpha=4.0, dense_under_budget=False, min_fetch_tokens=0)


def _without_lane(monkeypatch, model_and_skew, kernels, prompt, steps, **settings):
    """The reference: the same engine and tokens, every step on the Python path."""
    with monkeypatch.context() as patch:
        patch.setattr(DecodeLane, "for_work", staticmethod(lambda work: None))
        engine = make_tiny_engine(model_and_skew, kernels, **settings)
        logits = greedy_logits(engine, prompt, steps)
    return engine, logits


def _assert_decode_partial_keys_are_the_projections_products(engine, first_slot: int) -> None:
    """The partial keys the decode steps wrote (slots from `first_slot` on) against the policy's own products of the
    pool's keys (torch.bmm, as its prefill writes them), to the cache's rounding: a decode step sums in another
    order, so the float32 sums may differ in their last bits, a float16 cache by one float16 step and int8 codes by
    one code."""
    policy, size = engine.policy, engine.pool.size()
    assert size > first_slot
    for layer in policy.sparse_layers:
        keys = engine.pool.keys(layer)[:, first_slot:size]
        expected = stored_partial(torch.bmm(keys, policy.key_projections[layer]), policy.partial_store_dtype).transpose(1, 2)
        written = policy.partial_keys_t[layer][:, :, first_slot:size]
        if policy.coded:
            _assert_within_one_code(written, expected)
        else:
            torch.testing.assert_close(written.float(), expected.float(), rtol=2e-3, atol=1e-4)


def _assert_within_one_code(got: torch.Tensor, expected: torch.Tensor) -> None:
    """int8 partial keys [..., r + 1, slots]: each value within one code of its slot's scale (a sum's last bits
    can move a code across a rounding boundary, or a slot's largest channel across a power of two)."""
    got_values, expected_values = (partial_codes.decode(codes, channel_dim=-2) for codes in (got, expected))
    one_code = expected_values.abs().amax(dim=-2, keepdim=True) / 63
    assert ((got_values - expected_values).abs() <= one_code + 1e-7).all()


def _layer_record(step):
    return [(layer.layer, layer.sparse, layer.fetched, layer.window, layer.dense_reason, layer.attended,
             None if layer.selected_positions is None else layer.selected_positions.tolist(),
             None if layer.selected_read is None else layer.selected_read.tolist())
            for layer in step.layers]


@pytest.mark.parametrize("settings", [
    SELECTING,  # every step selects (from the first one the budget leaves rows out)
    dict(SELECTING, dense_under_budget=True, budget=230, budget_is_tokens=True),  # dense up to 230 tokens, then selects
    dict(SELECTING, budget_by_layer=False),  # the uniform budget
    dict(SELECTING, budget_by_head=False),  # k rows in every KV head (SELECTING: the heads share the budget)
    dict(policy="full"),
    dict(policy="offload"),
])
@torch.inference_mode()
def test_the_lane_gives_the_python_paths_logits_and_statistics(tiny_llama, kernels, monkeypatch, lane_steps,
                                                              settings):
    prompt, steps = random_tokens(200, seed=3), 70  # the pool grows past its first 256 slots mid-decode
    reference, expected = _without_lane(monkeypatch, tiny_llama, kernels, prompt, steps, **settings)
    assert not lane_steps
    engine = make_tiny_engine(tiny_llama, kernels, **settings)
    assert lane_refusal(engine.work) is None
    capacity = engine.pool.capacity
    got = greedy_logits(engine, prompt, steps)
    assert len(lane_steps) == steps and engine.pool.capacity > capacity  # every step in the lane, across a growth
    assert torch.equal(got, expected)  # to the bit: the same kernels and ops on the same inputs
    for ours, theirs in zip(engine.recent_decode_steps(), reference.recent_decode_steps()):
        assert _layer_record(ours) == _layer_record(theirs)
    assert engine.fetcher.bytes_fetched == reference.fetcher.bytes_fetched
    if settings["policy"] == "infinigen":
        assert any(layer.sparse for layer in engine.recent_decode_steps()[-1].layers)
        if settings["dense_under_budget"]:
            assert engine.recent_decode_steps()[0].dense_reason is not None
        assert torch.equal(engine.policy._partial_all, reference.policy._partial_all)  # the new keys' partial keys
        _assert_decode_partial_keys_are_the_projections_products(engine, len(prompt))  # dense steps' too
    assert torch.ops.infinigen_cpu.lane_end()[3].numel() == 0  # no lane left open on this thread
    engine.close(), reference.close()


SHORT_CHAT = dict(SELECTING, dense_under_budget=True, budget=230, budget_is_tokens=True)  # dense up to 230 tokens


@torch.inference_mode()
def test_a_short_chats_dense_steps_leave_their_partial_keys_until_something_reads_them(tiny_llama, kernels,
                                                                                     monkeypatch, lane_steps):
    """A dense step selects nothing, so the lane leaves its partial keys out; the policy makes them from the pool's
    keys, with the lane's own function, when they are read (a session's export here) or before anything writes
    the cache (a prefill after a truncate): the same bits as the Python path, which writes them at each step."""
    prompt, steps = random_tokens(40, seed=9), 12
    reference, expected = _without_lane(monkeypatch, tiny_llama, kernels, prompt, steps, **SHORT_CHAT)
    engine = make_tiny_engine(tiny_llama, kernels, **SHORT_CHAT)
    got = greedy_logits(engine, prompt, steps)
    assert len(lane_steps) == steps and torch.equal(got, expected)
    policy, size = engine.policy, engine.pool.size()
    assert policy.step_keys.unprojected == (len(prompt), size)  # every decode step's partial keys left out
    everything = torch.arange(size)
    for layer in policy.sparse_layers:
        assert torch.equal(policy.export_partial_keys(layer, everything),
                           reference.policy.export_partial_keys(layer, everything))
    assert policy.step_keys.unprojected is None
    _assert_decode_partial_keys_are_the_projections_products(engine, len(prompt))

    greedy_logits(engine, prompt[:3], 4)  # more dense steps to leave out, then a truncate and a prefill over them
    greedy_logits(reference, prompt[:3], 4)
    assert policy.step_keys.unprojected is not None
    for each in (engine, reference):
        each.truncate(size + 2)
    got, expected = greedy_logits(engine, prompt[:6], 3), greedy_logits(reference, prompt[:6], 3)
    assert torch.equal(got, expected)
    held = engine.pool.size()
    assert policy.step_keys.unprojected == (held - 3, held)  # the prefill made the ones it was to write over first
    policy.step_keys.complete()
    assert torch.equal(policy._partial_all[..., :held], reference.policy._partial_all[..., :held])
    engine.close(), reference.close()


@torch.inference_mode()
def test_sliding_layers_read_their_window_in_the_lane(kernels, monkeypatch, lane_steps):
    gemma = tiny_gemma()  # sliding layers of a 16-token window beside global ones that select
    settings = dict(policy="infinigen", budget=0.3, min_fetch_tokens=0, dense_under_budget=False)
    prompt = random_tokens(60, seed=4, vocab=3001)
    reference, expected = _without_lane(monkeypatch, gemma, kernels, prompt, 12, **settings)
    engine = make_tiny_engine(gemma, kernels, **settings)
    got = greedy_logits(engine, prompt, 12)
    assert len(lane_steps) == 12 and torch.equal(got, expected)
    step = engine.recent_decode_steps()[-1]
    assert _layer_record(step) == _layer_record(reference.recent_decode_steps()[-1])
    assert {layer.window for layer in step.layers} == {16, None} and any(layer.sparse for layer in step.layers)


@pytest.mark.parametrize("settings, reason", [
    (dict(policy="h2o"), "the h2o policy"),
    (dict(policy="streaming"), "the streaming policy"),
    (dict(SELECTING, pool_limit_tokens=240, recent_window=16), "a pool that evicts"),
    (dict(SELECTING, record_recall=True), "recall is measured"),
    (dict(SELECTING, selects_ahead=True), "selections are speculated a layer ahead"),
])
@torch.inference_mode()
def test_what_the_lane_does_not_cover_takes_the_python_path(tiny_llama, kernels, monkeypatch, lane_steps, settings,
                                                            reason):
    engine = make_tiny_engine(tiny_llama, kernels, **settings)
    assert lane_refusal(engine.work) == reason and engine.work.lane is None
    greedy_logits(engine, random_tokens(40, seed=6), 3)
    assert not lane_steps and engine.recent_decode_steps()[-1].layers  # the Python path ran and recorded
    without_kernels = make_tiny_engine(tiny_llama, None, **SELECTING)
    assert lane_refusal(without_kernels.work) == "no CPU kernels"
    engine.close(), without_kernels.close()


@torch.inference_mode()
def test_a_step_that_raises_closes_the_lane(tiny_llama, kernels, monkeypatch, lane_steps):
    engine = make_tiny_engine(tiny_llama, kernels, **SELECTING)
    engine.prefill(random_tokens(40, seed=7))
    mlp = engine.model.model.layers[2].mlp

    def broken(*args, **kwargs):
        raise RuntimeError("a layer failed")

    monkeypatch.setattr(mlp, "forward", broken)
    with pytest.raises(RuntimeError, match="a layer failed"):
        engine.decode(5)
    assert len(lane_steps) == 1 and torch.ops.infinigen_cpu.lane_end()[3].numel() == 0  # aborted: nothing open
    monkeypatch.undo()
    assert engine.num_tokens == 40 and engine.decode(5).isfinite().all()  # the engine goes on (the Python path's rule)
    engine.close()


@torch.inference_mode()
def test_the_compiled_step_runs_the_lane_and_hands_other_steps_to_python(tiny_llama, kernels, monkeypatch, lane_steps):
    """The graph calls the lane's op (with no Python per layer); a step with no lane open (a policy the lane does
    not cover) goes through the same graph to the Python path. Both give the eager reference's tokens."""
    if decode_lane.devices.active_mode() is not None:
        pytest.skip("no step compiles under the separate-devices checks")
    prompt = random_tokens(120, seed=8)
    _, expected = _without_lane(monkeypatch, tiny_llama, kernels, prompt, 8, **SELECTING)
    engine = make_tiny_engine(tiny_llama, kernels, **SELECTING)
    assert compile_decode(engine, progress=lambda message: None) is None
    assert engine.decode_step.is_compiled
    got = greedy_logits(engine, prompt, 8)
    assert len(lane_steps) >= 8
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # fused kernels sum in another order
    engine.reset()
    engine.configure(EngineConfig(policy="streaming", budget=0.2, min_fetch_tokens=0))
    opened = len(lane_steps)
    _, streaming = _without_lane(monkeypatch, tiny_llama, kernels, prompt, 4, policy="streaming", budget=0.2,
                                 min_fetch_tokens=0)
    got = greedy_logits(engine, prompt, 4)
    assert len(lane_steps) == opened and engine.decode_step.is_compiled
    torch.testing.assert_close(got, streaming, rtol=1e-4, atol=1e-4)
    engine.close()


def test_a_lane_whose_layers_did_not_all_attend_is_refused_at_its_end(kernels):
    """A layer that never reached the lane left its partial key unwritten and its selection missing: lane_end says
    so (and closes the lane) rather than hand the engine another layer's results."""
    keys = [torch.zeros(1, 8, 4) for _ in range(2)]
    torch.ops.infinigen_cpu.lane_begin(keys, [torch.zeros(1, 8, 4) for _ in range(2)], [None, None], [None, None],
                                       [None, None], [0, 0], 3, [0, 0], [0, 0], 1.0, True)
    query, new = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 1, 4)
    out = torch.ops.infinigen_cpu.attend_layer(query, new, new, None, None, None, 0, 0.5)
    assert out.shape == (1, 1, 2, 4) and torch.equal(keys[0][:, 3], new[0, :, 0])  # layer 0 ran: its row written
    with pytest.raises(RuntimeError, match="only some layers"):
        torch.ops.infinigen_cpu.lane_end()
    assert torch.ops.infinigen_cpu.lane_end()[3].numel() == 0  # closed all the same


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_a_decode_steps_partial_keys_are_the_projections_products_in_the_caches_dtype(kernels, dtype):
    """`write_step_partial_keys` (the Python path's call of the function the lane calls for each layer): every
    layer's new key through its own heads' projections, into its one slot, in the cache's dtype; float16's range
    bounds a key past it (65504, never an infinity), int8 codes' range too (127 x 2^9); no other slot is touched."""
    generator = torch.Generator().manual_seed(5)
    layers, heads, dim, r, capacity, slot = 3, 2, 16, 8, 10, 6
    keys = torch.randn(layers, heads, 1, dim, generator=generator)
    keys[1, 0] *= 1e6  # far past float16's range once projected
    projections = torch.randn(layers * heads, dim, r, generator=generator)
    cache = torch.zeros(layers, heads, r + (dtype == torch.int8), capacity, dtype=dtype)
    torch.ops.infinigen_cpu.write_step_partial_keys(keys, projections, cache, slot)
    expected = torch.bmm(keys.view(-1, 1, dim), projections).view(layers, heads, r)
    if dtype == torch.int8:
        _assert_within_one_code(cache[..., slot:slot + 1], partial_codes.encode(expected).unsqueeze(-1))
        assert partial_codes.decode(cache[..., slot], channel_dim=-1)[1, 0].abs().amax() == partial_codes.MAX_MAGNITUDE
    elif dtype == torch.float16:
        expected = expected.clamp(-65504.0, 65504.0).to(dtype)
        assert cache[1, 0, :, slot].abs().eq(65504.0).all()
    if dtype != torch.int8:
        torch.testing.assert_close(cache[..., slot], expected, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-5)
    others = [column for column in range(capacity) if column != slot]
    assert not cache[..., others].any()
