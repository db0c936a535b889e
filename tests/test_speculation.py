"""InfiniGen's speculation: rehearsed scores pick the tokens the layer will really attend to."""

import math

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import make_tiny_engine, random_tokens
from infinigen_core.policies.infinigen import InfiniGenPolicy


def test_choose_takes_the_planted_tokens_and_counts_alpha():
    policy = InfiniGenPolicy.__new__(InfiniGenPolicy)  # choose() needs only the config
    from infinigen_core.config import EngineConfig

    policy.ctx = type("Ctx", (), {"config": EngineConfig(alpha=2.0, budget=1.0)})()
    logits = torch.zeros(2, 2, 20)
    logits[0, 0, 7], logits[0, 1, 3] = 10.0, 9.5  # KV head 0: its two query heads like 7 and 3
    logits[1, :, 15] = 10.0  # KV head 1: both like 15
    logits[1, 0, 11] = 9.0
    logits[:, :, 19] = float("-inf")  # a future slot is never chosen
    selection = policy.choose(logits, past_len=19)
    # per query head within alpha=2 of its max: 1 token, except head (1,0) with 2 -> mean 1.25 -> k=2
    assert selection.alpha_count == 1.25
    assert selection.slots.shape == (2, 2)
    assert set(selection.slots[0].tolist()) == {7, 3}
    assert set(selection.slots[1].tolist()) == {15, 11}


def test_choose_respects_the_budget_cap():
    from infinigen_core.config import EngineConfig

    policy = InfiniGenPolicy.__new__(InfiniGenPolicy)
    policy.ctx = type("Ctx", (), {"config": EngineConfig(alpha=100.0, budget=0.1, min_fetch_tokens=0)})()
    selection = policy.choose(torch.randn(2, 3, 100), past_len=100)
    assert selection.alpha_count == 100  # every token is within alpha ...
    assert selection.slots.shape[1] == 10  # ... but the budget caps k at 10% of the context


@torch.inference_mode()
def test_full_channel_rehearsal_finds_the_true_top_k(tiny_llama):
    """Fed layer 4's own attention input, speculation with all channels reproduces its true attention."""
    model, _ = tiny_llama
    engine = make_tiny_engine(tiny_llama, policy="infinigen", partial_ratio=1.0, budget=0.1, alpha=1e9)
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
    speculated_layer, selection = engine.policy.speculate(target - 1, captured["hidden"], captured["rope"], position)
    engine.close()
    assert speculated_layer == target

    hidden, (cos, sin) = captured["hidden"], captured["rope"]
    heads, kv_heads, dim = 4, 2, 16
    query = attention.q_proj(hidden).view(1, 1, heads, dim).transpose(1, 2)
    query, _ = apply_rotary_pos_emb(query, query, cos, sin)
    keys = engine.pool.keys(target)  # [kv_heads, slots, dim], post-RoPE
    is_past = engine.pool.positions(target) < position
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
