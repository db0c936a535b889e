"""The compiled decode step (compiled.py): the tokens of eager decoding, no recompilation as a conversation
grows or its settings change, and eager decoding wherever compiling is unavailable or fails.

One tiny Llama is compiled with inductor once for the module (seconds from inductor's cache, ~15 s cold on
two cores); the fallback tests use dynamo with a failing backend, which compiles nothing.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from infinigen_core import devices
from infinigen_core.calibration import calibrate
from infinigen_core.compiled import EAGER_UNDER_CHECKS, compile_decode
from infinigen_core.config import EngineConfig

from conftest import _tiny_llama, make_tiny_engine, random_tokens

POOL_START = 256  # KVPool's first capacity: a conversation crossing it regrows the pool

# the dense path, InfiniGen selecting (speculation inside the attention op), H2O
# (attention weights read back), and a limited pool (eviction reorders slots mid-conversation)
POLICIES = [
    {"policy": "full"},
    {"policy": "infinigen", "budget": 0.3, "dense_under_budget": False},
    {"policy": "h2o", "budget": 0.3},
    {"policy": "full", "pool_limit_tokens": 64, "sink_tokens": 4, "recent_window": 16, "prefill_chunk": 32},
]


@pytest.fixture(scope="module")
def tiny_model():
    model = _tiny_llama()  # the module's own: nothing another test does to the shared one reaches it
    return model, calibrate(model, random_tokens(256, seed=1))


@pytest.fixture(scope="module")
def first_compile(tiny_model):
    """The module's one inductor compilation of the step; engines made after it over the model reuse it."""
    if devices.active_mode() is not None:
        pytest.skip("no step compiles under the separate-devices checks (a dispatch mode): compiled.py says so")
    messages = []
    engine = make_tiny_engine(tiny_model)
    reason = compile_decode(engine, progress=messages.append)
    yield engine, reason, messages
    engine.close()


@pytest.fixture
def compiled_and_eager(tiny_model, first_compile):
    """Two engines with the same settings over one model: the first compiled, the second eager (skipped under
    the separate-devices checks with `first_compile`)."""
    engines = []

    def make(**settings):
        for _ in range(2):
            engines.append(make_tiny_engine(tiny_model, **settings))
        assert compile_decode(engines[-2], progress=lambda message: None) is None
        return engines[-2], engines[-1]

    yield make
    for engine in engines:
        engine.close()


def greedy(engine, first: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [first], []
    for _ in range(steps):
        logits.append(engine.decode(tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def test_the_step_compiles_at_load_with_progress_messages(first_compile):
    engine, reason, messages = first_compile
    assert reason is None and engine.decode_step.label == "compiled decode"
    assert messages[0].startswith("Compiling the decode step") and messages[-1].startswith("Decode step compiled in")
    assert engine.num_tokens == 0 and not engine.history  # the warm-up step left no trace in the conversation


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_step_under_a_callers_dispatch_mode_runs_eager_and_the_mode_sees_every_op(tiny_model, first_compile):
    """Dynamo compiles nothing under a dispatch mode (bench's op counter is one): that step runs eager, so the
    mode sees each op an eager engine's step runs, and the compiled step stays for the next."""
    engine = first_compile[0]
    graphs = counters["stats"]["unique_graphs"]
    seen = []
    with make_tiny_engine(tiny_model) as eager:
        assert not eager.decode_step.is_compiled
        eager.decode(1)  # a first step, as compile_decode's warm-up ran one (it builds what later steps reuse)
        eager.reset()
        for each in (engine, eager):
            try:
                with _OpRecorder() as recorder:
                    each.decode(1)
                seen.append(recorder.ops)
            finally:
                each.reset()
    assert seen[0] == seen[1] and any("mm" in op for op in seen[0])
    assert engine.decode_step.is_compiled and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("settings", POLICIES, ids=["full", "infinigen", "h2o", "full-limited"])
def test_compiled_decode_gives_the_eager_tokens_as_the_pool_grows(compiled_and_eager, settings):
    graphs = counters["stats"]["unique_graphs"]
    compiled, eager = compiled_and_eager(**settings)
    assert eager.decode_step.label == "eager decode"
    prompt = random_tokens(POOL_START - 6, seed=3)
    compiled.prefill(prompt)
    eager.prefill(prompt)
    capacity = compiled.pool.capacity
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens, logits = greedy(compiled, prompt[-1], 12)
        expected, expected_logits = greedy(eager, prompt[-1], 12)
        if compiled.pool.limit_tokens is None:
            assert compiled.pool.capacity > capacity == POOL_START  # the pool was regrown mid-conversation
        else:
            assert compiled.pool.evicted_tokens > 0  # eviction reordered the slots mid-conversation
        # a prefill in between (many tokens: eager), then one-token steps again
        for engine in (compiled, eager):
            engine.prefill(random_tokens(5, seed=4))
        more, more_logits = greedy(compiled, 7, 5)
        more_expected, more_expected_logits = greedy(eager, 7, 5)
    assert tokens == expected and more == more_expected
    torch.testing.assert_close(torch.stack(logits + more_logits), torch.stack(expected_logits + more_expected_logits),
                               rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing was compiled again, for any engine or policy
    assert compiled.recent_decode_steps()[-1].layers  # the statistics of a compiled step are kept
    if settings.get("dense_under_budget") is False:
        assert compiled.recent_decode_steps()[-1].sparse_layers(), "the selecting path must have run"


def test_a_policy_change_keeps_the_compiled_step(compiled_and_eager):
    compiled, eager = compiled_and_eager(policy="full")
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for engine in (compiled, eager):
            engine.prefill(random_tokens(12, seed=5))
            engine.configure(EngineConfig(policy="streaming", min_fetch_tokens=0, budget=0.5))
        assert greedy(compiled, 3, 6)[0] == greedy(eager, 3, 6)[0]
    assert counters["stats"]["unique_graphs"] == graphs and compiled.decode_step.is_compiled


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("no compiler here (forced by the test)")


def test_a_step_that_fails_to_compile_runs_eager_with_the_reason_logged(tiny_model, monkeypatch, caplog):
    """Plain: the backend's failure is the reason. Under the separate-devices checks nothing is compiled at all
    (a dispatch mode): torch.compile is never called, and that is the reason given."""
    messages = []
    under_checks = devices.active_mode() is not None
    expected = EAGER_UNDER_CHECKS if under_checks else "no compiler here"
    compile_calls = []
    compile_model = torch.compile

    def recording_compile(*args, **kwargs):
        compile_calls.append(kwargs)
        return compile_model(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    with make_tiny_engine(tiny_model) as engine, make_tiny_engine(tiny_model) as reference:
        with caplog.at_level(logging.WARNING, logger="infinigen_core.compiled"):
            reason = compile_decode(engine, progress=messages.append, backend=_failing_backend)
        assert expected in reason and engine.decode_step.label == "eager decode"
        assert len(compile_calls) == (0 if under_checks else 1)
        assert messages[-1] == f"Decode steps run eager (torch.compile unavailable): {reason}"
        assert caplog.text.count("decode steps run eager") == 1
        prompt = random_tokens(8, seed=6)
        engine.prefill(prompt)
        reference.prefill(prompt)
        tokens, logits = greedy(engine, prompt[-1], 8)
        expected, expected_logits = greedy(reference, prompt[-1], 8)
        assert tokens == expected
        torch.testing.assert_close(torch.stack(logits), torch.stack(expected_logits), rtol=0, atol=0)
        assert caplog.text.count("decode steps run eager") == 1  # logged once, not per step


def test_where_torch_compile_itself_raises_decoding_stays_eager(tiny_model, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("torch.compile is not supported here (forced by the test)")

    monkeypatch.setattr(torch, "compile", refuse)
    fresh = (_tiny_llama(), tiny_model[1])  # the same weights, never compiled (a compiled model keeps its step)
    with make_tiny_engine(fresh) as engine:
        with caplog.at_level(logging.WARNING, logger="infinigen_core.compiled"):
            reason = compile_decode(engine, progress=lambda message: None)
        expected = "not supported here" if devices.active_mode() is None else EAGER_UNDER_CHECKS  # never called
        assert expected in reason and expected in caplog.text
        assert not engine.decode_step.is_compiled and engine.num_tokens == 0
        engine.prefill(random_tokens(6, seed=7))
        assert engine.decode(2).shape == (128,)


def test_without_a_cpp_compiler_decoding_stays_eager_without_trying(tiny_model, monkeypatch):
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))
    with make_tiny_engine(tiny_model) as engine:
        reason = compile_decode(engine, progress=lambda message: None)
        expected = "C++ compiler" if devices.active_mode() is None else EAGER_UNDER_CHECKS  # no probe needed
        assert expected in reason and engine.decode_step.label == "eager decode"


def test_the_model_summary_and_the_options_say_whether_decode_is_compiled(first_compile):
    from chat_service.model_host import ModelHost
    from infinigen_core.cli import build_parser
    from ui.cli import parse_args

    compiled = first_compile[0]
    compiled.model_name = "tiny"
    host = ModelHost()
    host.engine = compiled
    assert host.model_summary().endswith("· fp32 weights · compiled decode")
    assert parse_args([]).compile_decode is None and parse_args(["--no-compile"]).compile_decode is False
    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--compile"])
    assert generate.compile_decode is True
    seen = {}
    ModelHost(compile_decode=False, loader=lambda *args, **kwargs: seen.update(kwargs))._load(None, None, print)
    assert seen["compile_decode"] is False


def test_the_real_model_decodes_the_eager_logits_compiled(real_engine):
    """The default engine (compiled on the CPU, int4 weights) over InfiniGen's selecting path at ~300 tokens,
    several steps in a row, so that state kept from one step to the next (InfiniGen's partial keys) is checked
    too. Not bit for bit: the int4 layers round their input row to bf16, and inductor's fused norms move the
    fp32 value under that rounding by an ulp now and then; a log-probability then moves by up to ~0.35 (int4's
    own distance from fp32 is as large: docs/BENCHMARKS.md), and by up to ~1.1 where such an ulp swaps a row
    at the edge of a selection that later steps build on (measured with the CPU kernels, whose selections
    equal the eager ops' on the same inputs). State written wrongly moves them by 5-15."""
    from infinigen_core.calibration import calibration_text

    assert real_engine.decode_step.is_compiled, real_engine.decode_step.eager_reason
    assert real_engine.weights == "int4 weights (head q8_0)"  # the head's product is traced into the graph too
    ids = real_engine.tokenizer(calibration_text())["input_ids"]
    real_engine.prefill(ids[:300])
    compiled = real_engine.score(ids[300:310]).log_softmax(-1)
    real_engine.truncate(300)
    with torch.compiler.set_stance("force_eager"):
        eager = real_engine.score(ids[300:310]).log_softmax(-1)
    assert real_engine.history[-1].sparse_layers(), "the selecting path must have run"
    assert (compiled - eager).abs().amax(-1).max() < 1.5
    assert (compiled.argmax(-1) == eager.argmax(-1)).sum() >= 8
