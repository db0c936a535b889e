"""A Gemma 3 decode step costs InfiniGen no more than `full`: the suspects of issue 31, on a tiny config.

Gemma 3 brings a 262k vocabulary, sliding layers (window 512) beside global ones, per-type RoPE bases and
QK-norm. Each could make InfiniGen's step slower than the model's own: the compiled step recompiling as
the conversation crosses the window or as selection starts, or work over the vocabulary in every layer
(a rehearsal that ran the head, logits kept per layer). Behaviour, not timing: graph counts and the ops
that touch a vocabulary-sized tensor.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from infinigen_core.calibration import calibrate
from infinigen_core.compiled import compile_decode
from infinigen_core.config import EngineConfig
from infinigen_core.engine import InfiniGenEngine

from conftest import random_tokens

VOCAB = 3001  # no other size of the model shares it, so a vocabulary-sized tensor is known by its shape
WINDOW = 16
SELECTING = dict(policy="infinigen", budget=0.3, min_fetch_tokens=0, dense_under_budget=False)


def tiny_gemma():
    """A tiny random Gemma 3 (sliding layers of a 16-token window, two global ones) and its skew."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=1024,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention"], rope_theta=1_000_000.0, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model, calibrate(model, random_tokens(200, seed=1, vocab=VOCAB))


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


class VocabularyOps(TorchDispatchMode):
    """Names of the aten ops that read or write a tensor with a vocabulary-sized dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(kwargs or {}).values(), result) if isinstance(t, torch.Tensor)]
        if any(VOCAB in t.shape for t in tensors):
            self.names.append(func.overloadpacket.__name__)
        return result


def vocabulary_ops_per_step(engine: InfiniGenEngine, prompt: list[int]) -> list[str]:
    engine.reset()
    token = int(engine.prefill(prompt).argmax())
    with VocabularyOps() as ops:
        engine.decode(token)
    return ops.names


def test_infinigen_touches_the_vocabulary_only_in_the_head_as_full_does(gemma):
    model, skew = gemma
    prompt = random_tokens(60, seed=2, vocab=VOCAB)  # past the window: the sliding layers slice their rows
    full = vocabulary_ops_per_step(InfiniGenEngine(model, None, EngineConfig(policy="full"), skew_set=skew), prompt)
    engine = InfiniGenEngine(model, None, EngineConfig(**SELECTING), skew_set=skew)
    selecting = vocabulary_ops_per_step(engine, prompt)
    assert engine.history[-1].sparse_layers(), "the selecting path must have run"
    # the embedding lookup, the head and the logits' conversions: a few per step, none per layer
    assert selecting == full and len(full) < engine.adapter.num_layers


def test_the_compiled_step_never_recompiles_across_the_window_and_the_selection(gemma):
    """One graph for the whole conversation: dense under the budget, then selecting, past the sliding window."""
    model, skew = gemma
    engine = InfiniGenEngine(model, None, EngineConfig(policy="infinigen", budget=0.3, min_fetch_tokens=8),
                             skew_set=skew)
    graphs = counters["stats"]["unique_graphs"]
    assert compile_decode(engine, progress=lambda message: None, backend="eager") is None
    with torch._dynamo.config.patch(error_on_recompile=True):
        token = int(engine.prefill(random_tokens(6, seed=3, vocab=VOCAB)).argmax())
        for _ in range(3 * WINDOW):
            token = int(engine.decode(token).argmax())
    assert counters["stats"]["unique_graphs"] == graphs + 1
    kinds = [bool(step.sparse_layers()) for step in engine.recent_decode_steps()]
    assert not kinds[0] and kinds[-1]  # it began dense under the budget and ended selecting


def test_sliding_layers_show_their_window_not_a_selection(gemma):
    """Past the window a sliding layer reads its last WINDOW - 1 past tokens: its fetched ratio is that share of
    the context (not 1.0), the global layers keep theirs, and the step's summary shows the two kinds apart."""
    model, skew = gemma
    engine = InfiniGenEngine(model, None, EngineConfig(**SELECTING), skew_set=skew)
    engine.prefill(random_tokens(60, seed=2, vocab=VOCAB))
    engine.decode(5)
    step = engine.history[-1]
    sliding, others = step.sliding_layers(), [layer for layer in step.layers if not layer.is_sliding]
    assert [layer.layer for layer in sliding] == [0, 1, 3, 4] and all(layer.window == WINDOW for layer in sliding)
    assert all(layer.fetched == WINDOW - 1 and layer.fetched_ratio == (WINDOW - 1) / 60 for layer in sliding)
    assert [layer.sparse for layer in others] == [True, True]  # the global layers select
    summary = step.summary()
    assert summary["sliding_fetched_ratio"] == pytest.approx((WINDOW - 1) / 60)
    assert summary["fetched_ratio"] == step.fetched_ratio() < 1  # the global layers' selection, apart
