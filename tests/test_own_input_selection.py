"""Where the pool shares the compute device's memory, a selecting layer chooses its rows from its own input.

InfiniGen rehearses layer i+1 from layer i's input so that the fetch of its rows overlaps layer i's work.
With the pool on the compute device nothing is fetched across, so the engine rehearses each selecting layer
from its own attention input instead: with every channel that is the layer's true query, and the rows it
picks are the true top-k. Across devices (a GPU's host pool, emulated here) it still rehearses ahead.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from infinigen_core.config import ConfigError, EngineConfig

from conftest import decode_seeing_attention_inputs, make_tiny_engine, random_tokens

SETTINGS = dict(policy="infinigen", partial_ratio=1.0, budget=0.1, alpha=1e9, dense_under_budget=False)


@pytest.mark.one_device
@torch.inference_mode()
def test_a_selecting_layer_on_one_device_picks_the_true_top_k_of_its_own_query(tiny_llama):
    model, _ = tiny_llama
    engine = make_tiny_engine(tiny_llama, **SETTINGS)
    assert not engine.work.rehearses_ahead
    attentions = [layer.self_attn for layer in model.model.layers]
    captured = decode_seeing_attention_inputs(engine, attentions, random_tokens(150, seed=5), 7)
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
        rows = engine.policy.budget_for(layer, position)  # its share of the 10% budget (budget_shares.py)
        assert selected[layer].shape[1] == rows
        for kv in range(2):
            assert set(selected[layer][kv].tolist()) == set(weight[kv].topk(rows).indices.tolist()), (layer, kv)
    engine.close()


def count_selections(engine) -> dict[str, list[int]]:
    """The layers each of the policy's two ways of selecting was called for (ahead: the speculating layer)."""
    calls: dict[str, list[int]] = {"ahead": [], "own": []}
    for name, way in (("speculate", "ahead"), ("select_from_query", "own")):
        method = getattr(engine.policy, name)

        def counted(layer, *args, _method=method, _way=way, **kwargs):
            calls[_way].append(layer)
            return _method(layer, *args, **kwargs)

        setattr(engine.policy, name, counted)
    return calls


def test_across_devices_the_selection_is_still_rehearsed_one_layer_ahead(tiny_llama, separate_devices):
    engine = make_tiny_engine(tiny_llama, **SETTINGS)
    assert engine.work.rehearses_ahead
    calls = count_selections(engine)
    engine.prefill(random_tokens(150, seed=5))
    engine.decode(7)
    assert [stats.layer for stats in engine.history[-1].sparse_layers()] == [2, 3]
    assert calls == {"ahead": [1, 2], "own": []}  # layers 2 and 3 rehearsed from layers 1 and 2
    engine.close()


def test_the_setting_can_make_the_cpu_rehearse_ahead_as_the_gpu_path_does(tiny_llama):
    for setting, expected in ((True, {"ahead": [1, 2], "own": []}), (False, {"ahead": [], "own": [2, 3]})):
        with make_tiny_engine(tiny_llama, selects_ahead=setting, **SETTINGS) as engine:
            assert engine.work.rehearses_ahead is setting
            calls = count_selections(engine)
            engine.prefill(random_tokens(40, seed=3))
            assert engine.decode(5).isfinite().all()
            assert calls == expected
    with pytest.raises(ConfigError, match="selects_ahead"):
        EngineConfig(selects_ahead="yes")  # type: ignore[arg-type]
