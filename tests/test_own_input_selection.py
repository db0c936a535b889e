"""Where the pool shares the compute device's memory, a selecting layer chooses its rows from its own input.

InfiniGen rehearses layer i+1 from layer i's input so that the fetch of its rows overlaps layer i's work.
With the pool on the compute device nothing is fetched across, so the engine rehearses each selecting layer
from its own attention input instead: with every channel that is the layer's true query, and the rows it
picks are the true top-k. Across devices (a GPU's host pool, emulated here) it still rehearses ahead.
"""

from __future__ import annotations

import math

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import make_tiny_engine, random_tokens

SETTINGS = dict(policy="infinigen", partial_ratio=1.0, budget=0.1, alpha=1e9, dense_under_budget=False)


@torch.inference_mode()
def test_a_selecting_layer_on_one_device_picks_the_true_top_k_of_its_own_query(tiny_llama):
    model, _ = tiny_llama
    engine = make_tiny_engine(tiny_llama, **SETTINGS)
    assert not engine.work.rehearses_ahead
    captured = {}

    def capture(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    attentions = [layer.self_attn for layer in model.model.layers]
    hooks = [attention.register_forward_pre_hook(capture, with_kwargs=True) for attention in attentions]
    try:
        engine.prefill(random_tokens(150, seed=5))
        engine.decode(7)
    finally:
        for hook in hooks:
            hook.remove()
    position = engine.num_tokens - 1
    selected = {stats.layer: stats.selected_positions for stats in engine.history[-1].sparse_layers()}
    assert sorted(selected) == [2, 3]
    for layer in (2, 3):
        hidden, (cos, sin) = captured[layer]
        query = attentions[layer].q_proj(hidden).view(1, 1, 4, 16).transpose(1, 2)
        query, _ = apply_rotary_pos_emb(query, query, cos, sin)
        keys = engine.pool.keys(layer).to(engine.device)  # [2 kv heads, slots, 16]
        is_past = engine.pool.positions(layer).to(engine.device) < position
        logits = torch.einsum("hd,hsd->hs", query[0, :, 0], keys.repeat_interleave(2, dim=0)) / math.sqrt(16)
        weight = torch.softmax(logits.masked_fill(~is_past, float("-inf")), -1).view(2, 2, -1).sum(1)
        for kv in range(2):
            assert set(selected[layer][kv].tolist()) == set(weight[kv].topk(15).indices.tolist()), (layer, kv)
    engine.close()


def test_across_devices_the_selection_is_still_rehearsed_one_layer_ahead(tiny_llama, separate_devices):
    engine = make_tiny_engine(tiny_llama, **SETTINGS)
    assert engine.work.rehearses_ahead
    engine.prefill(random_tokens(150, seed=5))
    engine.decode(7)
    assert [stats.layer for stats in engine.history[-1].sparse_layers()] == [2, 3]
    engine.close()


def test_the_setting_can_make_the_cpu_rehearse_ahead_as_the_gpu_path_does(tiny_llama):
    from infinigen_core.config import ConfigError, EngineConfig

    with make_tiny_engine(tiny_llama, selects_ahead=True, **SETTINGS) as ahead:
        assert ahead.work.rehearses_ahead
        ahead.prefill(random_tokens(40, seed=3))
        assert ahead.decode(5).isfinite().all()  # the rehearsal ahead runs on the CPU too
    with make_tiny_engine(tiny_llama, selects_ahead=False, **SETTINGS) as own:
        assert not own.work.rehearses_ahead
    try:
        EngineConfig(selects_ahead="yes")  # type: ignore[arg-type]
    except ConfigError as error:
        assert "selects_ahead" in str(error)
    else:
        raise AssertionError("a malformed selects_ahead was accepted")
