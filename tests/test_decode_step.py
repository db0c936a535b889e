"""The decode step is built for a GPU: no host reads of device values, few operations, one copy to the host.

Counted on the CPU with a dispatch mode (`OpCounter`): every aten op there is a kernel launch on a GPU,
and the syncing ops are the ones that would stall the CPU until the GPU caught up.
"""

import pytest
import torch

from bench.opcount import OpCounter
from infinigen_core import EngineConfig, devices

from conftest import make_tiny_engine, random_tokens

POLICIES = ["full", "offload", "infinigen", "h2o", "streaming"]


def counted_decode_step(engine, token=5):
    """The step's ops, and its copies to the host besides those of the streamed fetch, where the pool is in
    host memory (a GPU, or INFINIGEN_SEPARATE_DEVICES=1): staged, the new K/V of each layer on their way to the
    pool and, where the worker gathers them (the staged fetch; streaming's slots, chosen in host memory), each
    sparse layer's selected slots. The zero-copy fetch writes the new K/V into the pool in place and sends no
    slot (zero_copy.py)."""
    copies = engine.fetcher.host.copies
    with OpCounter() as ops:
        engine.decode(token)
    streamed = 0
    if engine.pool.device != engine.device:
        mapped = getattr(engine.fetcher, "mapped", None) is not None
        slots_stay = mapped and engine.policy.name != "streaming"
        streamed = (0 if mapped else 2 * engine.adapter.num_layers) + (
            0 if slots_stay else len(engine.history[-1].sparse_layers()))
    return ops, engine.fetcher.host.copies - copies - streamed


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_step_reads_nothing_back_from_the_device(tiny_llama, policy):
    with make_tiny_engine(tiny_llama, policy=policy, budget=0.2) as engine:
        engine.prefill(random_tokens(300, seed=1))
        engine.decode(3)  # the first step after a prefill may grow per-slot state
        ops, host_copies = counted_decode_step(engine)
    assert ops.syncs == 0, ops.sync_counts()
    # InfiniGen's alpha counts go to the host in one copy per step; the other policies send nothing
    assert host_copies == (1 if policy == "infinigen" else 0)


def test_the_op_counter_sees_host_reads():
    with OpCounter() as ops:
        x = torch.arange(10)
        int(x.sum()), (x > 3).nonzero(), x[x > 5]
    assert ops.syncs >= 3 and "nonzero" in ops.counts


def test_infinigen_launches_few_operations_more_than_full(real_engine):
    """On the real model at ~1k tokens: at most 1.4x the aten operations of a dense step (was 1.80x)."""
    from infinigen_core.calibration import calibration_text

    ids = real_engine.tokenizer(calibration_text())["input_ids"]
    real_engine.prefill(ids[:1000])
    counts = {}
    for policy in ("full", "infinigen"):
        real_engine.configure(EngineConfig(policy=policy))
        real_engine.truncate(1000)
        real_engine.decode(ids[1000])
        real_engine.truncate(1000)
        ops, _ = counted_decode_step(real_engine, ids[1000])
        assert ops.syncs == 0, (policy, ops.sync_counts())
        counts[policy] = ops.total
    assert real_engine.history[-1].sparse_layers(), "the sparse path must have run"
    assert counts["infinigen"] <= 1.4 * counts["full"], counts


def test_no_pool_growth_inside_a_prepared_reply(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.2) as engine:
        engine.prefill(random_tokens(40, seed=1))
        engine.prepare(300)
        storage = engine.pool._storage.layers[0].keys.data_ptr()
        partial = engine.policy.partial_keys_t[3].data_ptr()
        engine.score(random_tokens(250, seed=2))
        assert engine.pool._storage.layers[0].keys.data_ptr() == storage
        assert engine.policy.partial_keys_t[3].data_ptr() == partial


def test_settings_changes_keep_the_pool(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="infinigen") as engine:
        engine.prefill(random_tokens(50, seed=1))
        pool = engine.pool
        engine.configure(EngineConfig(policy="offload", min_fetch_tokens=0))
        engine.configure(EngineConfig(policy="full", budget=0.5, min_fetch_tokens=0))
        if not devices.has_separate_host(engine.device):  # on the CPU every policy's pool is the same
            assert engine.pool is pool
        assert engine.pool.total_tokens == 50
        pool = engine.pool
        engine.configure(EngineConfig(policy="full", pool_limit_tokens=128))
        assert engine.pool is not pool and engine.pool.total_tokens == 50  # a limit is a different pool


@torch.inference_mode()
def test_the_fused_rotary_rehearsal_equals_the_adapters(tiny_llama):
    """InfiniGen's two-product RoPE + skew gives what rehearse_query followed by the skew gives."""
    model, _ = tiny_llama
    engine = make_tiny_engine(tiny_llama, policy="infinigen")
    captured = {}
    attention = model.model.layers[2].self_attn
    hook = attention.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    try:
        engine.prefill(random_tokens(30, seed=1))
        engine.decode(9)
    finally:
        hook.remove()
    policy, adapter = engine.policy, engine.adapter
    assert policy.rotary[3]
    fused = policy._rehearse(3, captured["hidden_states"], captured["position_embeddings"], torch.tensor([30]))
    query = adapter.rehearse_query(model.model.layers[3].self_attn, captured["hidden_states"],
                                   captured["position_embeddings"])
    expected = query.view(2, 2, -1) @ policy.projections[3] * adapter.logit_scale
    engine.close()
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_truncate_keeps_the_partial_key_cache_in_place(tiny_llama):
    """An edit or regenerate without eviction forgets tokens by length alone: nothing is regrown or recomputed."""
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.2) as engine:
        engine.prefill(random_tokens(120, seed=1))
        cache = engine.policy.partial_keys_t[3]
        before = cache[:, :, :80].clone()
        engine.truncate(80)
        assert engine.policy.partial_keys_t[3] is cache and torch.equal(cache[:, :, :80], before)
        engine.score(random_tokens(5, seed=2))  # and decoding goes on from there
        assert engine.num_tokens == 85


@pytest.mark.parametrize("policy", ["infinigen", "h2o", "streaming"])
def test_under_the_budget_sparse_layers_attend_densely_as_full_does(tiny_llama, policy):
    """A short chat (budget floor >= tokens held): exactly `full`'s logits, no rehearsal, a reason to show."""
    from infinigen_core.engine import DENSE_UNDER_BUDGET

    prompt, replies = random_tokens(40, seed=3), random_tokens(8, seed=4)
    full = make_tiny_engine(tiny_llama, policy="full")
    sparse = make_tiny_engine(tiny_llama, policy=policy, budget=0.15, min_fetch_tokens=256)
    # h2o computes attention explicitly (it reads the weights), not through SDPA: equal up to rounding
    same = torch.equal if policy != "h2o" else lambda a, b: torch.allclose(a, b, atol=1e-5)
    try:
        assert same(full.prefill(prompt), sparse.prefill(prompt))
        for token in replies:
            assert same(full.decode(token), sparse.decode(token))
        step = sparse.history[-1]
        assert step.dense_reason == DENSE_UNDER_BUDGET and step.fetched_ratio() == 1.0
        later = [layer for layer in step.layers if layer.layer >= sparse.config.dense_layers]
        assert later and all(layer.dense_reason == DENSE_UNDER_BUDGET and layer.fetched_ratio == 1.0 for layer in later)
        assert all(layer.dense_reason is None for layer in step.layers if layer.layer < sparse.config.dense_layers)
        full_ops, _ = counted_decode_step(full)
        sparse_ops, host_copies = counted_decode_step(sparse)
        assert sparse_ops.syncs == 0 and host_copies == 0
        assert "topk" not in sparse_ops.counts and "gather" not in sparse_ops.counts
        # h2o's explicit attention costs its own ops at any context; with the pool in host memory `full` keeps its
        # pool on the compute device and reads it in place, while the others take the streamed fetch
        if policy != "h2o" and not devices.has_separate_host(sparse.device):
            # the new token's partial keys are still kept (a few ops for the whole step), nothing more
            assert sparse_ops.total <= full_ops.total + 12, (sparse_ops.total, full_ops.total)
    finally:
        full.close()
        sparse.close()


def test_past_the_budget_the_sparse_path_runs_again(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.15, min_fetch_tokens=32) as engine:
        engine.prefill(random_tokens(30, seed=3))
        engine.decode(4)
        assert engine.history[-1].dense_reason is not None
        engine.score(random_tokens(8, seed=5))  # 39 tokens held: past the floor of 32
        step = engine.history[-1]
        assert step.dense_reason is None and step.sparse_layers()
        assert step.fetched_ratio() < 1.0
