"""Shared fixtures: tiny random-weight models for exact unit tests, one real engine for integration tests.

Unit tests build models from a config (seconds, exact). Integration tests share a single real
SmolLM2 engine per test session because loading and calibrating it costs seconds each time;
the `engine` fixture hands it out reset to an empty conversation with default settings.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from infinigen_core.calibration import calibrate
from infinigen_core.config import EngineConfig
from infinigen_core.engine import InfiniGenEngine

TINY_VOCAB = 128


def random_tokens(n: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=generator).tolist()


def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def _tiny_opt():
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=64)
    return OPTForCausalLM(config).eval()


@pytest.fixture(scope="session")
def kernels(tmp_path_factory):
    """InfiniGen's CPU kernels, built once per test run (a process registers them once: cpu_kernels.build)."""
    from infinigen_core import cpu_kernels

    built, reason = cpu_kernels.build(tmp_path_factory.mktemp("kernels"))
    assert built is not None, reason  # this machine has the compiler inductor needs: the kernels must build
    return built


@pytest.fixture(scope="session")
def tiny_llama():
    """(model, skew_set) for a 4-layer Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    model = _tiny_llama()
    return model, calibrate(model, random_tokens(256, seed=1))


@pytest.fixture(scope="session")
def tiny_opt():
    """(model, skew_set) for a 4-layer OPT (multi-head attention with q/k biases)."""
    model = _tiny_opt()
    return model, calibrate(model, random_tokens(256, seed=1))


def make_tiny_engine(model_and_skew, kernels=None, **settings) -> InfiniGenEngine:
    """An engine over a tiny model (with the CPU kernels given, if any); the fetch floor is off unless asked for,
    since tiny tests use short contexts."""
    settings.setdefault("min_fetch_tokens", 0)
    model, skew = model_and_skew
    return InfiniGenEngine(model, None, EngineConfig(**settings), skew_set=skew, fingerprint="tiny", kernels=kernels)


@pytest.fixture
def lane_steps(monkeypatch):
    """How many steps opened the C++ decode lane (decode_lane.py): a list that grows by one per such step."""
    from infinigen_core.decode_lane import DecodeLane

    opened: list[int] = []
    begin = DecodeLane.begin

    def counted(self, step):
        if begin(self, step):
            opened.append(step.first_position)
            return True
        return False

    monkeypatch.setattr(DecodeLane, "begin", counted)
    return opened


def hold_int8_partial_codes(engine: InfiniGenEngine) -> None:
    """Make an eager engine's InfiniGen policy (built, nothing prefilled) hold the CPU kernels' int8 partial keys
    and score them as the kernel does (policies/partial_codes.py, `logits`), so that it selects what an engine with
    the kernels selects."""
    policy = engine.policy
    capacity = policy._partial_all.shape[3]
    policy.partial_store_dtype, policy.coded, policy._partial_all = torch.int8, True, None
    policy.ensure_capacity(capacity)


def greedy_logits(engine: InfiniGenEngine, prompt: list[int], steps: int) -> torch.Tensor:
    """Prefill `prompt`, then decode `steps` greedy tokens from its last one: each step's logits [steps, vocab]."""
    engine.prefill(prompt)
    logits, token = [], prompt[-1]
    for _ in range(steps):
        out = engine.decode(token)
        logits.append(out)
        token = int(out.argmax())
    return torch.stack(logits)


def decode_seeing_attention_inputs(engine: InfiniGenEngine, attentions: list[torch.nn.Module], prompt: list[int],
                                   token: int) -> dict[int, tuple]:
    """Prefill `prompt`, decode `token`; per attention module given, its (hidden_states, position_embeddings) at
    that last step (each call overwrites the last)."""
    seen: dict[int, tuple] = {}

    def keep(module, args, kwargs) -> None:
        seen[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    hooks = [attention.register_forward_pre_hook(keep, with_kwargs=True) for attention in attentions]
    try:
        engine.prefill(prompt)
        engine.decode(token)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.fixture(scope="session")
def real_engine_shared():
    from infinigen_core.devices import SEPARATE_DEVICES_ENV
    from infinigen_core.loading import load_engine

    separate = os.environ.pop(SEPARATE_DEVICES_ENV, None)  # shared by every test: always the plain CPU's
    try:
        return load_engine(device="cpu", config=EngineConfig(), progress=lambda message: None)
    finally:
        if separate is not None:
            os.environ[SEPARATE_DEVICES_ENV] = separate


@pytest.fixture
def real_engine(real_engine_shared):
    """The real default engine (SmolLM2-135M-Instruct on the CPU), empty and with default settings."""
    real_engine_shared.reset()
    real_engine_shared.configure(EngineConfig())
    yield real_engine_shared
    real_engine_shared.reset()


# The GPU machine's image has torch and transformers but none of the app's packages (gradio, sqlite-utils,
# openai...). There `python -m pytest -m cuda` collects only the files that hold CUDA tests, instead of failing
# to import the app's test files; anywhere else (CI included) a missing package still fails loudly.
CUDA_TEST_FILES = {"test_cuda.py", "test_fetch_pipeline.py"}
APP_PACKAGES = ("gradio", "gradio_client", "fastapi", "sqlite_utils", "openai")


def pytest_ignore_collect(collection_path, config):
    if "cuda" not in (config.option.markexpr or "") or collection_path.suffix != ".py":
        return None
    if collection_path.name.startswith("test_") and collection_path.name not in CUDA_TEST_FILES:
        if any(importlib.util.find_spec(name) is None for name in APP_PACKAGES):
            return True
    return None


# CUDA's rules on the CPU (infinigen_core/devices.py): the tests of these files build engines that compute on
# the emulated device with the pool in emulated host memory, and run under the mode that refuses what a GPU
# would refuse. CI runs `python -m pytest`, so the files themselves turn it on, not an environment variable.
SEPARATE_DEVICES_TEST_FILES = {"test_separate_devices.py", "test_policies.py", "test_fetch_pipeline.py",
                               "test_session_storage.py", "test_gpu_bench.py"}


@pytest.fixture
def separate_devices(monkeypatch):
    """INFINIGEN_SEPARATE_DEVICES=1 and the checking mode, for the whole test."""
    from infinigen_core.devices import SEPARATE_DEVICES_ENV, SeparateDevicesMode

    monkeypatch.setenv(SEPARATE_DEVICES_ENV, "1")
    with SeparateDevicesMode():
        yield


def _whole_run_separated() -> bool:
    """`INFINIGEN_SEPARATE_DEVICES=1 python -m pytest tests/test_x.py`: every test of the run under the mode,
    not only the files above (how a file is checked before it joins them)."""
    from infinigen_core.devices import separate_devices_requested

    return separate_devices_requested()


# what these files (and tests marked `one_device`) test exists only where pool and compute share one device (the
# CPU kernels read the pool in place; a layer selects with its own query), so a whole run under the mode skips
# them rather than report the path it switched off as failing
ONE_DEVICE_TEST_FILES = {"test_cpu_kernels.py", "test_decode_lane.py"}


def pytest_collection_modifyitems(config, items):
    whole_run = _whole_run_separated()
    for item in items:
        if whole_run and (item.path.name in ONE_DEVICE_TEST_FILES or item.get_closest_marker("one_device")):
            item.add_marker(pytest.mark.skip(reason="a path that runs only where pool and compute share a device"))
        # the real engine is shared by the whole run and built once, on the plain CPU: it keeps it
        if (whole_run or item.path.name in SEPARATE_DEVICES_TEST_FILES) and "separate_devices" not in item.fixturenames \
                and not {"real_engine", "real_engine_shared"} & set(item.fixturenames):
            item.fixturenames.insert(0, "separate_devices")
