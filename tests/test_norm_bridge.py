"""The rehearsal reads layer i's attention input as layer i+1's input norm would have made it (norm_bridge.py).

Layer i's input went through layer i's norm gains; layer i+1 applies its own to nearly the same residual.
On a tiny Gemma 3 whose input norms differ per layer and whose sliding layer before the global one adds
nothing to the residual, the bridged rehearsal is the global layer's exact query, and with every channel it
picks the true top-k; fed unbridged, it is not.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from infinigen_core.arch import ModelAdapter
from infinigen_core.calibration import calibrate
from infinigen_core.norm_bridge import input_bridge, norm_affine

from conftest import make_tiny_engine, random_tokens

SOURCE, TARGET = 1, 2  # a sliding layer, then the global layer it rehearses for


def _randomised(norm: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.7 + 0.3)
    return norm


@pytest.mark.parametrize("make", [lambda: Gemma3RMSNorm(64, eps=1e-6), lambda: LlamaRMSNorm(64, eps=1e-5),
                                  lambda: torch.nn.LayerNorm(64)], ids=["gemma3", "llama", "layernorm"])
def test_the_bridge_turns_one_norms_output_into_the_others(make):
    source, target = _randomised(make(), 1), _randomised(make(), 2)
    residual = torch.randn(5, 64) * 3 + 1
    scale, offset = input_bridge(source, target)
    with torch.no_grad():
        bridged = source(residual) * scale + offset
        assert not torch.allclose(source(residual), target(residual), atol=1e-2)
        torch.testing.assert_close(bridged, target(residual), atol=1e-4, rtol=1e-4)


def test_the_probe_reads_gemmas_one_plus_w_gain():
    norm = _randomised(Gemma3RMSNorm(64, eps=0.0), 3)
    gain, shift = norm_affine(norm)
    torch.testing.assert_close(gain, 1 + norm.weight.detach())
    assert not shift.any()


def test_equal_or_absent_norms_need_no_bridge():
    assert input_bridge(LlamaRMSNorm(64), LlamaRMSNorm(64)) is None  # equal gains: nothing to change
    assert input_bridge(None, LlamaRMSNorm(64)) is None
    olmo = transformers.AutoModelForCausalLM.from_config(transformers.Olmo2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
    # OLMo 2 normalises after attention: its attention reads the residual itself, in every layer alike
    assert ModelAdapter.for_model(olmo).input_norms == (None, None)


@pytest.fixture(scope="module")
def gemma_with_distinct_norms():
    """A tiny Gemma 3 (sliding, sliding, global, ...) whose input norms differ per layer, and whose layer 1
    leaves the residual as it is (its attention and MLP outputs are zero), so layer 2's input norm reads the
    very residual layer 1's did."""
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=1024,
        sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            _randomised(layer.input_layernorm, 10 + index)
        model.model.layers[SOURCE].self_attn.o_proj.weight.zero_()
        model.model.layers[SOURCE].mlp.down_proj.weight.zero_()
    return model, calibrate(model, random_tokens(200, seed=1))


def _attention_inputs(engine, model, prompt):
    captured = {}

    def capture(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    hooks = [model.model.layers[layer].self_attn.register_forward_pre_hook(capture, with_kwargs=True)
             for layer in (SOURCE, TARGET)]
    try:
        engine.prefill(prompt)
        engine.decode(7)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


@torch.inference_mode()
def test_the_rehearsed_query_is_the_global_layers_own_when_the_residual_holds(gemma_with_distinct_norms):
    model, _ = gemma_with_distinct_norms
    engine = make_tiny_engine(gemma_with_distinct_norms, policy="infinigen", partial_ratio=0.5, budget=0.2,
                              alpha=1e9, dense_under_budget=False, dense_layers=2)
    captured = _attention_inputs(engine, model, random_tokens(80, seed=5))
    policy, adapter = engine.policy, engine.adapter
    position = torch.tensor([engine.num_tokens - 1])
    rehearsed = policy._rehearse(TARGET, *captured[SOURCE], position)
    true_query = adapter.rehearse_query(model.model.layers[TARGET].self_attn, captured[TARGET][0], None, position)
    expected = torch.bmm(true_query.reshape(1, 4, 32).float(), policy.single_query_projections[TARGET])
    engine.close()
    torch.testing.assert_close(rehearsed, expected, atol=1e-4, rtol=1e-4)
    policy.input_bridges.clear()  # the same rehearsal read as layer 1's norm left it is off
    assert not torch.allclose(policy._rehearse(TARGET, *captured[SOURCE], position), expected, atol=1e-2)


@torch.inference_mode()
def test_full_channel_speculation_picks_the_global_layers_true_top_k(gemma_with_distinct_norms):
    model, _ = gemma_with_distinct_norms
    engine = make_tiny_engine(gemma_with_distinct_norms, policy="infinigen", partial_ratio=1.0, budget=0.1,
                              alpha=1e9, dense_under_budget=False, dense_layers=2)
    captured = _attention_inputs(engine, model, random_tokens(150, seed=6))
    position = engine.num_tokens - 1
    selection = engine.policy.speculate(SOURCE, *captured[SOURCE], torch.tensor([position]), past_len=position)
    query = engine.adapter.rehearse_query(model.model.layers[TARGET].self_attn, captured[TARGET][0], None,
                                          torch.tensor([position]))  # [heads, 1, dim], QK-normed and rotated
    keys = engine.pool.keys(TARGET).to(engine.device)[0]  # one KV head, [slots, dim]
    is_past = engine.pool.positions(TARGET).to(engine.device) < position
    logits = (query[:, 0] @ keys.T * engine.adapter.logit_scale).masked_fill(~is_past, float("-inf"))
    expected = set(torch.softmax(logits, -1).sum(0).topk(15).indices.tolist())  # 10% of 150 past tokens
    engine.close()
    assert selection.slots.shape == (1, 15)
    assert set(selection.slots[0].tolist()) == expected
