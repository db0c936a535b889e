"""Int8 decode weights (infinigen_core/weights.py): one-row steps in int8, prefill exactly fp32, a clean fallback."""

import copy
import logging

import pytest
import torch

from conftest import make_tiny_engine, random_tokens
from infinigen_core.loading import ModelLoadError, resolve_weights
from infinigen_core.weights import (Int8DecodeLinear, plain_fp32_weights, restore_fp32_weights,
                                    use_int8_decode_weights, weights_label)
from torch import nn


def _int8_copy(tiny_llama, monkeypatch):
    model, skew = tiny_llama
    model = copy.deepcopy(model)
    monkeypatch.setattr("infinigen_core.weights.MIN_INT8_WEIGHTS", 1)  # the tiny model's layers are small
    assert use_int8_decode_weights(model) > 0
    return model, skew


def test_the_layer_runs_int8_for_one_row_and_fp32_for_more():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = Int8DecodeLinear(linear)
    assert layer.weight is linear.weight  # the fp32 parameter is kept, not copied
    batch = torch.randn(1, 7, 64)
    assert torch.equal(layer(batch), linear(batch))
    row = torch.randn(1, 1, 64)
    out, exact = layer(row), linear(row)
    assert out.shape == exact.shape and not torch.equal(out, exact)
    assert (out - exact).norm() / exact.norm() < 0.05


@torch.inference_mode()
def test_int8_decoding_keeps_the_greedy_tokens_and_prefill_exact(tiny_llama, monkeypatch):
    quantized = _int8_copy(tiny_llama, monkeypatch)
    assert weights_label(quantized[0]) == "int8 weights" and weights_label(tiny_llama[0]) == "fp32 weights"
    assert type(quantized[0].lm_head) is nn.Linear  # the output head stays fp32 (its input has outliers)
    prompt = random_tokens(60, seed=2)
    engines = [make_tiny_engine(m, policy="full") for m in (tiny_llama, quantized)]
    try:
        first = [engine.prefill(prompt) for engine in engines]
        # prefill's last row goes through the output head as one row: an int8 head would change the first
        # reply token (it did on SmolLM2-135M); kept fp32, the first token's logits are the fp32 model's exactly
        assert torch.equal(first[0], first[1])
        # the prompt's K/V (what sessions save) are the fp32 model's, bit for bit
        for layer in range(engines[0].adapter.num_layers):
            assert torch.equal(engines[0].pool.keys(layer), engines[1].pool.keys(layer))
            assert torch.equal(engines[0].pool.values(layer), engines[1].pool.values(layer))
        token = [int(random_tokens(1, seed=3)[0])] * 2
        agree = 0
        for _ in range(16):
            logits = [engine.decode(t) for engine, t in zip(engines, token)]
            torch.testing.assert_close(logits[1], logits[0], atol=0.05, rtol=0)
            agree += int(logits[0].argmax() == logits[1].argmax())
            token = [int(logits[0].argmax())] * 2  # teacher-forced on the fp32 tokens
        assert agree >= 15
    finally:
        for engine in engines:
            engine.close()


def test_the_fp32_layers_come_back(tiny_llama, monkeypatch):
    model, _ = _int8_copy(tiny_llama, monkeypatch)
    head = model.lm_head.weight
    with plain_fp32_weights(model):
        assert not any(isinstance(m, Int8DecodeLinear) for m in model.modules())
        assert model.lm_head.weight is head  # the same Parameter (a tied head stays tied)
    assert any(isinstance(m, Int8DecodeLinear) for m in model.modules())
    restore_fp32_weights(model)
    assert weights_label(model) == "fp32 weights"


def test_without_the_quantized_engine_int8_falls_back_to_fp32_and_says_why(tiny_llama, monkeypatch, caplog):
    model = copy.deepcopy(tiny_llama[0])
    monkeypatch.setattr("infinigen_core.weights.quantized_engines", lambda: ["qnnpack", "none"])
    with caplog.at_level(logging.WARNING, logger="infinigen_core.weights"):
        assert use_int8_decode_weights(model) == 0
    assert "x86/fbgemm" in caplog.text and weights_label(model) == "fp32 weights"


def test_the_weights_option_defaults_to_fp32_and_int8_is_for_the_cpu():
    assert resolve_weights(None, torch.device("cpu")) == "fp32"
    assert resolve_weights(None, torch.device("cuda")) == "fp32"
    assert resolve_weights("fp32", torch.device("cpu")) == "fp32"
    with pytest.raises(ModelLoadError, match="CPU"):
        resolve_weights("int8", torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="unknown weights"):
        resolve_weights("int4", torch.device("cpu"))
