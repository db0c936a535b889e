"""The CUDA path, on a GPU only (`python -m pytest -m cuda`); skipped where PyTorch sees no CUDA device.

Exactness at a 100% budget, issue 29's first-run paths against the CPU, a decode step with no host sync under
`set_sync_debug_mode("error")`, and 8/4-bit weights through bitsandbytes.
"""

import pytest
import torch

from infinigen_core.calibration import calibrate
from infinigen_core.config import EngineConfig
from infinigen_core.engine import InfiniGenEngine

from conftest import _tiny_llama, _tiny_opt, random_tokens


def _real_engine(**kwargs):
    """The default model on the GPU, or a skip where it cannot be had (the device image has no network and no
    gguf unless scripts/device_carry.py's parts were carried in)."""
    from infinigen_core import ModelLoadError, load_engine

    try:
        return load_engine(device="cuda", progress=lambda message: None, **kwargs)
    except (ModelLoadError, ImportError) as error:
        pytest.skip(f"the default model cannot be loaded here: {error}"[:300])


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_engine(build, **settings):
    model = build().to("cuda")
    skew = calibrate(model, random_tokens(256, seed=1), "cuda")
    settings.setdefault("min_fetch_tokens", 0)
    return InfiniGenEngine(model, None, EngineConfig(**settings), skew_set=skew, device="cuda")


@pytest.mark.parametrize("build", [_tiny_llama, _tiny_opt])
def test_full_budget_matches_full_on_cuda(build):
    prompt, continuation = random_tokens(96, seed=3), random_tokens(12, seed=4)
    results = {}
    for policy in ("full", "offload", "infinigen"):
        with cuda_engine(build, policy=policy, budget=1.0, alpha=1e9, prefill_chunk=40) as engine:
            first = engine.prefill(prompt)
            results[policy] = torch.cat([first.unsqueeze(0), engine.score(continuation)]).cpu()
    torch.testing.assert_close(results["infinigen"], results["full"], rtol=0, atol=1e-4)
    torch.testing.assert_close(results["offload"], results["full"], rtol=0, atol=1e-4)


def _logits_on(device: str, conversation, **settings) -> torch.Tensor:
    """The conversation's logits on `device`, with the same weights and the CPU's skew on both sides (so both
    select from the same projections), and the GPU's selection on both: rehearsed one layer ahead (the CPU,
    where pool and compute share memory, would otherwise select with each layer's own query)."""
    model = _tiny_llama()
    skew = calibrate(model, random_tokens(256, seed=1))
    config = EngineConfig(min_fetch_tokens=0, prefill_chunk=40, selects_ahead=True, **settings)
    with InfiniGenEngine(model.to(device), None, config, skew_set=skew, device=device) as engine:
        return torch.stack(conversation(engine))


@pytest.mark.parametrize("case", ["configure-after-prefill", "restore", "one-token-restore", "streaming"])
def test_the_paths_the_first_run_would_have_broken(case):
    """Issue 29's first-run bugs, on the card (tests/test_separate_devices.py holds them on the CPU): the policy
    switched over a filled pool, a restored session (90 tokens, and one), streaming's host-side slots."""
    tokens = 1 if case == "one-token-restore" else 90
    policy = {"configure-after-prefill": "full", "streaming": "streaming"}.get(case, "infinigen")

    def conversation(engine):
        logits = [engine.prefill(random_tokens(tokens, seed=3)).float().cpu()]
        if case == "configure-after-prefill":
            engine.configure(engine.config.with_changes(policy="infinigen", budget=0.3))
        elif case.endswith("restore"):
            saved = [engine.export_rows(0, tokens)]
            engine.reset()
            assert engine.import_rows(saved) == tokens
        return logits + [logits.float().cpu() for logits in engine.score(random_tokens(4, seed=4))]

    torch.testing.assert_close(_logits_on("cuda", conversation, policy=policy, budget=0.3),
                               _logits_on("cpu", conversation, policy=policy, budget=0.3), rtol=0, atol=1e-4)


def test_selected_rows_gathered_in_place_on_the_card():
    """zero_copy.py on a real card: the CUDA view of the pinned pool passes its check at load (a gather and a write
    through it), and the logits are the staged path's (indices to the host, host gather, copy up; new rows copied
    down and written by the worker), through a pool that grows."""
    results, reasons = {}, {}
    for zero_copy in (False, True):
        with cuda_engine(_tiny_llama, policy="infinigen", budget=0.2, dense_under_budget=False,
                         zero_copy_fetch=zero_copy) as engine:
            reasons[zero_copy] = engine.fetcher.zero_copy_reason
            first = engine.prefill(random_tokens(250, seed=3))
            results[zero_copy] = torch.cat([first.unsqueeze(0), engine.score(random_tokens(12, seed=4))]).cpu()
    assert reasons[True] is None, f"the zero-copy fetch fell back: {reasons[True]}"
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=1e-5)


def test_rows_written_through_the_pinned_view_land_in_host_memory():
    """transfer.CudaOps.scatter: a kernel on the compute stream writes rows into pinned host memory over UVA; once
    the compute side's event is reached the host reads them, and the rows it did not write are as they were."""
    from infinigen_core.transfer import CudaOps

    ops = CudaOps("cuda")
    host = ops.host_empty((64, 8), torch.float16)
    host.copy_(torch.arange(64 * 8, dtype=torch.float16).view(64, 8))
    before = host.clone()
    rows = torch.randn(3, 8, device="cuda", dtype=torch.float16)
    ops.scatter(ops.mapped(host), torch.tensor([2, 40, 63], device="cuda"), rows)
    ops.compute_done().synchronize()
    assert torch.equal(host[[2, 40, 63]], rows.cpu())
    untouched = [row for row in range(64) if row not in (2, 40, 63)]
    assert torch.equal(host[untouched], before[untouched])


@pytest.mark.parametrize("policy", ["infinigen", "offload", "full"])
def test_a_decode_step_does_not_sync(policy):
    with cuda_engine(_tiny_llama, policy=policy, budget=0.2) as engine:
        engine.prefill(random_tokens(300, seed=1))
        engine.prepare(8)
        engine.decode(3)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.decode(4)  # the logits stay on the device: reading the token is the caller's one read
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_real_model_full_budget_matches_full_on_cuda():
    from infinigen_core.calibration import calibration_text

    with _real_engine(config=EngineConfig(policy="full")) as engine:
        ids = engine.tokenizer(calibration_text())["input_ids"][:300]
        expected = engine.prefill(ids[:280]), engine.score(ids[280:])
        engine.reset()
        engine.configure(EngineConfig(policy="infinigen", budget=1.0, alpha=1e9))
        actual = engine.prefill(ids[:280]), engine.score(ids[280:])
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=2e-2)  # fp16 on the GPU


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_quantized_weights_answer_a_question(bits):
    pytest.importorskip("bitsandbytes")  # not in the GPU device image
    from infinigen_core.config import SamplingConfig
    from infinigen_core.generation import chat_token_ids, generate

    with _real_engine(config=EngineConfig(), quantize=bits) as engine:
        ids = chat_token_ids(engine.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
        events = list(generate(engine, ids, SamplingConfig(max_new_tokens=24)))
    assert "Paris" in events[-1].full_text
