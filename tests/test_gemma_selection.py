"""On one device, a Gemma 3 global layer picks its rows from its own query: QK-norm, the global RoPE base and
`query_pre_attn_scalar` included, whatever the sliding layer before it did to the residual.

The tiny model's input norms differ per layer (as a trained Gemma's do: `1 + w`), so the query rehearsed
from the previous layer's input, the one InfiniGen uses to fetch ahead across devices, is not the layer's own;
with every channel the own-input selection is the true top-k, and the rehearsal ahead is not.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from infinigen_core.calibration import calibrate

from conftest import decode_seeing_attention_inputs, make_tiny_engine, random_tokens

SOURCE, TARGET = 1, 2  # a sliding layer, then the global layer after it
SETTINGS = dict(policy="infinigen", partial_ratio=1.0, budget=0.1, alpha=1e9, dense_under_budget=False,
                dense_layers=2)


@pytest.fixture(scope="module")
def gemma_with_distinct_norms():
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=1024,
        sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(torch.randn(64, generator=generator) * 0.7 + 0.3)
    return model, calibrate(model, random_tokens(200, seed=1))


@pytest.mark.one_device
@torch.inference_mode()
def test_a_global_layer_picks_the_true_top_k_of_its_own_query(gemma_with_distinct_norms):
    model, _ = gemma_with_distinct_norms
    engine = make_tiny_engine(gemma_with_distinct_norms, **SETTINGS)
    assert not engine.work.rehearses_ahead
    captured = decode_seeing_attention_inputs(engine, [model.model.layers[layer].self_attn for layer in (SOURCE, TARGET)],
                                              random_tokens(150, seed=6), 7)
    position = engine.num_tokens - 1
    query = engine.adapter.rehearse_query(model.model.layers[TARGET].self_attn, captured[TARGET][0], None,
                                          torch.tensor([position]))  # [heads, 1, dim], QK-normed and rotated
    keys = engine.pool.keys(TARGET).to(engine.device)[0]  # one KV head, [slots, dim]
    is_past = engine.pool.positions(TARGET).to(engine.device) < position
    logits = (query[:, 0] @ keys.T * engine.adapter.logit_scale).masked_fill(~is_past, float("-inf"))
    rows = engine.policy.budget_for(TARGET, position)  # the layer's share of 10% of 150 past tokens
    expected = set(torch.softmax(logits, -1).sum(0).topk(rows).indices.tolist())
    selected = {stats.layer: stats.selected_positions for stats in engine.history[-1].sparse_layers()}
    ahead = engine.policy.speculate(SOURCE, *captured[SOURCE], torch.tensor([position]), past_len=position)
    engine.close()
    assert sorted(selected) == [2, 3] and selected[TARGET].shape == (1, rows)
    assert set(selected[TARGET][0].tolist()) == expected
    assert set(ahead.slots[0].tolist()) != expected  # the case tells the two apart
