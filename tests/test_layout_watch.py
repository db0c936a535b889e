"""The compiled forward without dynamo's module guards (layout_watch.py): each model runs its own graph, a
swapped layer is compiled again (once per layout), a forward's own registrations cost no layout check, and
a model moved to another dtype is refused instead of run through the old graph.

Dynamo's eager backend keeps these fast: what is checked is which graph runs, not inductor's kernels (the
CPU's default options go through the same class: tests/test_compiled.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infinigen_core import layout_watch
from infinigen_core.layout_watch import LayoutCompiled

OPTIONS = {"fullgraph": True, "dynamic": False, "backend": "eager"}
IDS = torch.tensor([[1, 2, 3, 4, 5]])


def tiny(layers: int, hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def logits(forward) -> torch.Tensor:
    with torch.inference_mode():
        return forward(input_ids=IDS, use_cache=False).logits


def test_models_of_one_class_each_run_their_own_graph():
    """Without module guards, a shared code object would hand the second model the first one's graph (its layer
    count and sizes baked in)."""
    first, second = tiny(2, 32, seed=0), tiny(3, 64, seed=1)
    compiled = [LayoutCompiled(model, OPTIONS) for model in (first, second)]
    for model, forward in zip((first, second), compiled):
        torch.testing.assert_close(logits(forward), logits(model))
    assert LayoutCompiled.shared(first, OPTIONS) is LayoutCompiled.shared(first, OPTIONS)  # engines share it


def test_a_swapped_layer_is_compiled_again_once_per_layout():
    model = tiny(2, 32, seed=0)
    forward = LayoutCompiled(model, OPTIONS)
    before = logits(forward)
    mlp = model.model.layers[1].mlp
    plain = mlp.down_proj
    with_bias = torch.nn.Linear(plain.in_features, plain.out_features, bias=True)
    with torch.no_grad():
        with_bias.weight.copy_(plain.weight)
        with_bias.bias.fill_(0.5)  # a graph traced without the bias would not add it
    mlp.down_proj = with_bias
    swapped = logits(forward)
    torch.testing.assert_close(swapped, logits(model))
    assert not torch.allclose(swapped, before) and forward.layouts == 2
    mlp.down_proj = plain
    torch.testing.assert_close(logits(forward), before)
    assert forward.layouts == 2  # the first layout's graph again, not a third compilation


def test_a_forwards_own_registrations_cost_no_layout_check(monkeypatch):
    """Llama's forward slices its ModuleList, which registers every layer into a new list at each call."""
    model = tiny(2, 32, seed=0)
    forward = LayoutCompiled(model, OPTIONS)
    logits(forward)
    checks = []
    layout = layout_watch._layout
    monkeypatch.setattr(layout_watch, "_layout", lambda model: checks.append(model) or layout(model))
    for _ in range(3):
        logits(forward)
        logits(model)  # eager: the slicing registers for real
    assert checks == []
    model.lm_head = torch.nn.Linear(32, 96, bias=False)  # a registration in the model: looked at once
    for _ in range(2):
        torch.testing.assert_close(logits(forward), logits(model))
    assert checks == [model] and forward.layouts == 2


def test_a_model_moved_to_another_dtype_is_refused():
    model = tiny(2, 32, seed=0)
    forward = LayoutCompiled(model, OPTIONS)
    logits(forward)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="another dtype or device"):
        logits(forward)
