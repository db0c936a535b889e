"""InfiniGen's speculation: rehearsed scores pick the tokens the layer will really attend to."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from infinigen_core.policies.infinigen import InfiniGenPolicy

from conftest import make_tiny_engine, random_tokens


def _chooser(**settings):
    from infinigen_core.config import EngineConfig

    policy = InfiniGenPolicy.__new__(InfiniGenPolicy)  # choose() needs only the config and the rank buffer
    policy.ctx = type("Ctx", (), {"config": EngineConfig(**settings), "compute_device": torch.device("cpu"),
                                  "adapter": type("Adapter", (), {"num_heads": 4, "num_layers": 0})(), "pool": None})()
    policy._rank_thresholds = torch.empty(1, 0, dtype=torch.int64)
    policy.partial_keys_t, policy._partial_all, policy.sparse_layers = [], None, []
    policy.is_sparse = lambda layer: False
    return policy


def test_choose_ranks_the_planted_tokens_and_masks_past_the_alpha_count():
    policy = _chooser(alpha=2.0, budget=1.0)
    logits = torch.zeros(2, 2, 20)
    logits[0, 0, 7], logits[0, 1, 3] = 10.0, 9.5  # KV head 0: its two query heads like 7 and 3
    logits[1, :, 15] = 10.0  # KV head 1: both like 15
    logits[1, 0, 11] = 9.0
    logits[:, :, 19] = float("-inf")  # a future slot is never chosen
    selection = policy.choose(logits, k=19)
    # per query head within alpha=2 of its max: 1 token, except head (1,0) with 2 -> 5 over 4 heads -> mean 1.25
    assert int(selection.alpha_total) == 5
    assert selection.slots.shape == (2, 19) and 19 not in selection.slots.tolist()
    assert set(selection.slots[0, :2].tolist()) == {7, 3}  # ranked: the planted tokens come first
    assert set(selection.slots[1, :2].tolist()) == {15, 11}
    # the new token (column 0) and ceil(1.25) = 2 ranked rows stay; the rest are masked in attention
    assert selection.valid.tolist() == [[True, True, True] + [False] * 17]


def test_choose_respects_the_budget_cap():
    policy = _chooser(alpha=100.0, budget=0.1, min_fetch_tokens=0)
    selection = policy.choose(torch.randn(2, 3, 100), k=10)
    assert int(selection.alpha_total) == 600  # every token is within alpha ...
    assert selection.slots.shape[1] == 10 and bool(selection.valid.all())  # ... but the budget caps k at 10


def test_the_slot_being_written_is_never_chosen_even_when_weights_underflow():
    policy = _chooser(alpha=1.0, budget=1.0)
    logits = torch.full((1, 4, 8), -1e4)
    logits[:, :, 0] = 1e4  # every other weight underflows to exactly 0
    selection = policy.choose(logits, k=7, new_slots=torch.tensor([5]))
    assert 5 not in selection.slots.tolist()


@torch.inference_mode()
def test_full_channel_rehearsal_finds_the_true_top_k(tiny_llama):
    """Fed layer 4's own attention input, speculation with all channels reproduces its true attention."""
    model, _ = tiny_llama
    # a uniform budget, k in every head: the test checks the rehearsal against the true top k of a known size
    engine = make_tiny_engine(tiny_llama, policy="infinigen", partial_ratio=1.0, budget=0.1, alpha=1e9,
                              budget_by_layer=False, budget_by_head=False)
    target = 3
    captured = {}

    def capture(module, args, kwargs):
        captured["hidden"], captured["rope"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    attention = model.model.layers[target].self_attn
    hook = attention.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        engine.prefill(random_tokens(150, seed=5))
        engine.decode(7)
    finally:
        hook.remove()
    position = engine.num_tokens - 1
    selection = engine.policy.speculate(target - 1, captured["hidden"], captured["rope"], torch.tensor([position]),
                                        past_len=position)
    engine.close()

    hidden, (cos, sin) = captured["hidden"], captured["rope"]
    heads, kv_heads, dim = 4, 2, 16
    query = attention.q_proj(hidden).view(1, 1, heads, dim).transpose(1, 2)
    query, _ = apply_rotary_pos_emb(query, query, cos, sin)
    keys = engine.pool.keys(target).to(engine.device)  # [kv_heads, slots, dim], post-RoPE (the pool: maybe host memory)
    is_past = engine.pool.positions(target).to(engine.device) < position
    logits = torch.einsum("hd,hsd->hs", query[0, :, 0], keys.repeat_interleave(2, dim=0)) / math.sqrt(dim)
    logits = logits.masked_fill(~is_past, float("-inf"))
    group_weight = torch.softmax(logits, -1).view(kv_heads, 2, -1).sum(1)
    k = selection.slots.shape[1]
    assert k == 15  # 10% of 150 past tokens
    for kv in range(kv_heads):
        expected = set(group_weight[kv].topk(k).indices.tolist())
        assert set(selection.slots[kv].tolist()) == expected


def test_partial_channels_mostly_agree_with_the_true_attention(real_engine):
    """On the real model at the default budget the fetched set carries most of the attention mass."""
    from infinigen_core.calibration import calibration_text
    from infinigen_core.config import EngineConfig

    real_engine.configure(EngineConfig(record_recall=True, min_fetch_tokens=0))  # the budget alone decides
    ids = real_engine.tokenizer(calibration_text())["input_ids"]
    real_engine.prefill(ids[:600])
    real_engine.score(ids[600:606])
    sparse = [layer for layer in real_engine.history[-1].layers if layer.sparse]
    assert len(sparse) == 28
    recall = sum(layer.attention_recall for layer in sparse) / len(sparse)
    fetched = sum(layer.fetched_ratio for layer in sparse) / len(sparse)
    assert fetched <= EngineConfig.budget + 0.01  # k is rounded up to a whole token
    assert recall > 0.8 and recall > fetched + 0.4, (recall, fetched)


def test_a_step_never_reuses_the_previous_steps_rope_factors(tiny_llama):
    """A captured step hands its RoPE factors back in the same tensor each step, with new values: the policy
    must rebuild its rotation from them at every step, not keep the last step's (cached by identity)."""
    model, _ = tiny_llama
    engine = make_tiny_engine(tiny_llama, policy="infinigen", partial_ratio=1.0, budget=0.1, alpha=1e9,
                              selects_ahead=True)
    captured = {}

    def capture(module, args, kwargs):
        captured["hidden"], captured["rope"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    hook = model.model.layers[2].self_attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        engine.prefill(random_tokens(60, seed=5))
        engine.decode(7)
    finally:
        hook.remove()
    hidden, (cos, sin) = captured["hidden"], captured["rope"]
    shared_cos, shared_sin = cos.clone(), sin.clone()  # one buffer, as a graph's output would be
    policy, position = engine.policy, torch.tensor([engine.num_tokens - 1])
    with torch.inference_mode():  # as the engine's steps run
        first = policy._rehearse(3, hidden, (shared_cos, shared_sin), position)
        policy.finish_step(False)  # the step ends; the next one writes new positions into the same buffer
        shared_cos.copy_(torch.roll(cos, 1, dims=-1)), shared_sin.copy_(torch.roll(sin, 1, dims=-1))
        second = policy._rehearse(3, hidden, (shared_cos, shared_sin), position)
        fresh = policy._rehearse(3, hidden, (shared_cos.clone(), shared_sin.clone()), position)
    engine.close()
    assert not torch.equal(first, fresh)
    torch.testing.assert_close(second, fresh, rtol=0, atol=0)


def test_heads_sharing_a_budget_read_by_their_weights_kv_times_k_rows():
    """The heads' shared budget (EngineConfig.budget_by_head): head 0's group puts its weight on 2 tokens, head 1's
    spreads it over 12; with k = 5 each and a width of 10, head 0 reads 2 rows and head 1 8, together 2 x 5. Each
    head's mask is its own (the new token, column 0, always kept), and the alpha rank cuts them as before."""
    logits = torch.full((2, 2, 40), -20.0)
    logits[0, :, [3, 9]] = 10.0
    logits[1, :, 10:22] = torch.linspace(10.0, 9.0, 12)  # 12 tokens of nearly equal weight
    selection = _chooser(alpha=1e9, budget=1.0).choose(logits, k=5, width=10)
    assert selection.slots.shape == (2, 10) and selection.valid.shape == (2, 11)
    assert selection.per_head == selection.rows_per_head == 5
    assert selection.valid[:, 1:].sum(dim=1).tolist() == [2, 8] and bool(selection.valid[:, 0].all())
    assert set(selection.slots[0, :2].tolist()) == {3, 9}
    assert set(selection.slots[1, :8].tolist()) == set(range(10, 18))  # head 1's eight best
    # alpha 2: 2 tokens within it for each of head 0's two queries, 12 for head 1's: 28 over 4 query heads, so the
    # rows ranked 7th and after are cut, head 1's eighth among them
    cut = _chooser(alpha=2.0, budget=1.0).choose(logits, k=5, width=10)
    assert int(cut.alpha_total) == 28 and cut.valid[:, 1:].sum(dim=1).tolist() == [2, 7]


def test_the_rows_a_selection_read_are_marked_even_where_a_masked_slot_repeats_them():
    """Past a head's share the kernel's slots may repeat rows the head read (masked): recall's mark of the rows read
    keeps them, and masked rows alone stay unmarked."""
    from infinigen_core.attention import rows_read

    rows = torch.tensor([[3, 5, 3, 5, 6], [1, 2, 4, 0, 1]])
    read = torch.tensor([[True, True, False, False, False], [True, True, True, False, False]])
    marked = rows_read(rows, read, 7)
    assert marked[0].nonzero().squeeze(1).tolist() == [3, 5] and marked[1].nonzero().squeeze(1).tolist() == [1, 2, 4]
    assert rows_read(rows, read[:1], 7)[1].nonzero().squeeze(1).tolist() == [1, 2]  # one mask for every head
    assert rows_read(rows, None, 7)[0].nonzero().squeeze(1).tolist() == [3, 5, 6]


@pytest.mark.one_device  # the heads share a budget only where the pool is the compute device's memory
def test_heads_sharing_a_budget_read_as_many_rows_as_the_uniform_budget(tiny_llama, kernels):
    """On the CPU the heads share each layer's budget: the selections change, but each layer still reads k rows per
    head on average, in the statistics and in the bytes counted (lane or Python path alike)."""
    settings = dict(policy="infinigen", budget=0.3, alpha=1e9)
    for without_kernels_reading_in_place in (dict(kernels=None), dict(kernels=kernels, pool_limit_tokens=500)):
        with make_tiny_engine(tiny_llama, **without_kernels_reading_in_place, **settings) as engine:
            assert not engine.policy.heads_share_budget  # rows gathered: every head's copy would be 2k wide
    seen = {}
    for share in (True, False):
        engine = make_tiny_engine(tiny_llama, kernels=kernels, budget_by_head=share, **settings)
        assert engine.policy.heads_share_budget == share
        engine.prefill(random_tokens(120, seed=3))
        logits = engine.score(random_tokens(4, seed=4))
        steps = [step for step in engine.history if step.is_decode]
        seen[share] = ([layer.fetched for step in steps for layer in step.sparse_layers()],
                       engine.fetcher.bytes_fetched, logits)
        engine.close()
    assert seen[True][:2] == seen[False][:2] and len(seen[True][0]) > 0
    assert not torch.equal(seen[True][2], seen[False][2])  # the heads did read other rows
