"""GPU decode speed of full / offload / hf-offload / InfiniGen on Llama-2-7B- and Llama-3-8B-shaped models.

    python -m bench gpu --models llama2-7b,llama3-8b --context 4096,8192,16384,32768 \
        --budgets 0.15,0.1 --save docs/results/gpu-h100.json

`hf-offload` is plain transformers with `DynamicCache(offloading=True)`: what a transformers user picks to
keep the cache off the GPU. Every row carries tokens_per_s, the speed-up over `offload` and `hf-offload`,
the ratio to `full`, bytes fetched per token, the fetch wait per step, the achieved host-to-device rate
against the pinned peak, and the peak GPU memory.

Weights are random (fp16, allocated straight on the GPU from a meta-device skeleton): speed does not
depend on their values, and InfiniGen's budget is fixed (alpha so large that the budget cap always
binds), so every step fetches the same share of the cache. The pool sits in pinned host memory for
offload and infinigen; `full` keeps the whole cache on the GPU. The peak host-to-device bandwidth is
measured with a pinned copy and the achieved rate (bytes fetched per token / time per token) is
reported against it. Without a CUDA device it prints so and exits 0. Each row is written to `--save` as
soon as it is measured (a run cut short keeps what it measured).

    INFINIGEN_SEPARATE_DEVICES=1 python -m bench gpu --emulate --context 1024 --decode-tokens 4 --save F

runs the same flow (prefill under `full`, switch the policy over the filled pool, decode) on the CPU with
the pool and the compute side kept apart as on a GPU (infinigen_core/devices.py), with the tiny shape
unless --models names others, and writes the same rows: it proves the flow before a GPU run.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from infinigen_core import EngineConfig
from .common import EvalError

NO_CUDA_MESSAGE = "no CUDA device: the GPU benchmark needs one, nothing was measured"


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float


SHAPES = {
    "llama2-7b": ModelShape("Llama-2-7B (MHA)", 4096, 11008, 32, 32, 32, 32000, 10000.0),
    "llama3-8b": ModelShape("Llama-3-8B (GQA)", 4096, 14336, 32, 32, 8, 128256, 500000.0),
    # for --emulate on the CPU: the flow and the row format, not the speed, at a size a test can run
    "tiny": ModelShape("tiny Llama (GQA)", 128, 256, 4, 4, 2, 256, 10000.0),
}


def parse_shapes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if not names or unknown:
        raise EvalError(f"unknown model shape {', '.join(unknown) or '(none)'}: choose from {', '.join(SHAPES)}")
    return names


def peak_h2d_gbps(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best pinned host -> device copy rate in GB/s (10^9 bytes per second)."""
    host = torch.empty(megabytes * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, host.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
    del host, device
    return best


def random_llama(shape: ModelShape, max_context: int, device: str = "cuda", dtype: torch.dtype = torch.float16):
    # max_context is the window the model is built with: every context plus its decode steps must fit
    """A Llama of this shape with random weights, allocated on `device` without a CPU copy first."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                         max_position_embeddings=max_context, rope_theta=shape.rope_theta)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02)
    # to_empty leaves the rotary frequencies (a computed buffer) uninitialised: compute them again
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)
    return model.eval().requires_grad_(False)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decode_ms(engine, tokens: Sequence[int], device: str) -> tuple[list[float], int, float, dict]:
    """Each step's ms, the bytes fetched, the median fetch wait, and per step the copies sent to the host and the
    calls handed to the fetch worker (host work that a captured step could not hold)."""
    fetched_before = engine.fetcher.bytes_fetched
    copies_before, calls_before = engine.fetcher.host.copies, getattr(engine.fetcher, "worker_calls", 0)
    step_ms, wait_ms = [], []
    for token in tokens:
        _synchronize(device)
        started = time.perf_counter()
        engine.decode(int(token))
        _synchronize(device)
        step_ms.append((time.perf_counter() - started) * 1e3)
        wait_ms.append(sum(layer.fetch_wait_ms for layer in engine.history[-1].layers))
    host_work = {"host_copies_per_step": (engine.fetcher.host.copies - copies_before) / len(tokens),
                 "worker_calls_per_step": (getattr(engine.fetcher, "worker_calls", 0) - calls_before) / len(tokens)}
    return step_ms, engine.fetcher.bytes_fetched - fetched_before, statistics.median(wait_ms), host_work


@torch.inference_mode()
def _hf_offload_ms(model, ids: Sequence[int], context: int, steps: int) -> list[float]:
    """Plain transformers, DynamicCache(offloading=True): prefill `context` tokens, time `steps` decode steps."""
    from transformers import DynamicCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache(config=model.config, offloading=True)
        for start in range(0, context, 1024):
            piece = torch.tensor([list(ids[start : min(start + 1024, context)])], device="cuda")
            model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step_ms = []
        for token in ids[context : context + steps + 1]:
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(input_ids=torch.tensor([[int(token)]], device="cuda"), past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - started) * 1e3)
        del cache
    finally:
        model.set_attn_implementation(previous)
    return step_ms[1:]  # the first step is a warm-up


def bench_config(budget: float) -> EngineConfig:
    """The engine's settings in every row (the predictor reads the same: gpu_predict.py). Alpha so large that
    the budget always binds, and no fetch floor: InfiniGen fetches exactly budget x context rows."""
    return EngineConfig(policy="full", alpha=1e6, budget=budget, prefill_chunk=1024, history_steps=8,
                        min_fetch_tokens=0)


class RowWriter:
    """The result so far, rewritten to `path` after every row: a run cut short (a time limit) keeps them."""

    def __init__(self, path: Path | None, header: dict) -> None:
        self.path, self.header, self.rows = path, header, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        add_ratios(self.rows)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".part")
            partial.write_text(json.dumps({**self.header, "rows": self.rows}, indent=1) + "\n", encoding="utf-8")
            partial.replace(self.path)

    def result(self) -> dict:
        return {**self.header, "rows": self.rows}


@dataclass(frozen=True)
class BenchTarget:
    """Where the benchmark runs: a CUDA device, or the CPU under CUDA's rules (devices.py) with a tiny shape."""

    device: str  # "cuda" or "cpu"
    dtype: torch.dtype
    name: str
    peak_h2d_gbps: float | None

    @property
    def emulated(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class StepOptions:
    """How the engine's decode step runs: `compile_mode` eager, default (inductor) or reduce-overhead (inductor
    with CUDA graphs); `trace`: a folder for TRACED_STEPS consecutive profiled steps per model, context and policy
    (InfiniGen at the first budget), or None."""

    compile_mode: str = "eager"
    trace: Path | None = None


def gpu_benchmark(shape_names: Sequence[str], contexts: Sequence[int], policies: Sequence[str],
                  budgets: Sequence[float], decode_steps: int, progress=print, save: Path | None = None,
                  emulate: bool = False, compile_mode: str = "eager", trace: Path | None = None) -> dict:
    """Rows per (model, context, policy, budget): tokens_per_s, speed-ups, ratio to full, bytes, waits, memory.

    `emulate`: the same flow on the CPU with the pool and the compute side kept apart as on a GPU
    (INFINIGEN_SEPARATE_DEVICES=1 and its checking mode); hf-offload needs CUDA and is left out there.
    `compile_mode` and `trace`: see StepOptions; every row says which step it timed (`step`).
    """
    options = StepOptions(compile_mode, trace)
    if emulate:
        from infinigen_core.devices import SEPARATE_DEVICES_ENV, SeparateDevicesMode

        os.environ[SEPARATE_DEVICES_ENV] = "1"
        target = BenchTarget("cpu", torch.float32, "CPU emulating separate devices (INFINIGEN_SEPARATE_DEVICES=1)", None)
        writer = RowWriter(save, {"cuda": False, "emulated": True, "device": target.name, "peak_h2d_gbps": None,
                                  "compile": compile_mode})
        with SeparateDevicesMode():
            _measure(shape_names, contexts, [p for p in policies if p != "hf-offload"], budgets, decode_steps,
                     progress, target, writer, options)
        return writer.result()
    if not torch.cuda.is_available():
        return {"cuda": False, "message": NO_CUDA_MESSAGE, "rows": []}
    target = BenchTarget("cuda", torch.float16, torch.cuda.get_device_name(0), peak_h2d_gbps())
    progress(f"peak pinned host-to-device copy: {target.peak_h2d_gbps:.1f} GB/s")
    writer = RowWriter(save, {"cuda": True, "device": target.name, "peak_h2d_gbps": target.peak_h2d_gbps,
                              "compile": compile_mode, "torch": torch.__version__})
    _measure(shape_names, contexts, policies, budgets, decode_steps, progress, target, writer, options)
    return writer.result()


def _measure(shape_names, contexts, policies, budgets, decode_steps, progress, target: BenchTarget,
             writer: RowWriter, options: StepOptions) -> None:
    from infinigen_core import InfiniGenEngine
    from infinigen_core.calibration import calibrate

    tokens_after = max(decode_steps, TRACED_STEPS + 1 if options.trace is not None else 0)  # timed or traced
    window = max(contexts) + tokens_after + 2
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        progress(f"building {shape.name} with random {str(target.dtype)[6:]} weights on {target.name}")
        model = random_llama(shape, window, target.device, target.dtype)
        generator = torch.Generator().manual_seed(0)
        skew = calibrate(model, torch.randint(0, shape.vocab, (256,), generator=generator).tolist(), target.device)
        fixed = bench_config(budgets[0])
        engine = InfiniGenEngine(model, None, fixed, skew_set=skew, device=target.device, fingerprint=shape_name)
        try:
            _compile_step(engine, options.compile_mode, progress, writer)
            for context in contexts:
                ids = torch.randint(0, shape.vocab, (context + tokens_after + 2,), generator=generator).tolist()
                _measure_context(engine, model, shape, ids, context, policies, budgets, decode_steps, progress,
                                 target, writer, options)
        finally:
            engine.close()
            del engine, model
            if target.device == "cuda":
                torch.cuda.empty_cache()


def _compile_step(engine, compile_mode: str, progress, writer: RowWriter) -> None:
    """Compile the engine's decode step as asked (before its first prefill); why it stays eager goes in the header."""
    if compile_mode == "eager":
        return
    from infinigen_core.compiled import compile_decode

    options = {} if compile_mode == "default" else {"mode": compile_mode}
    if compile_mode == "reduce-overhead":
        # each layer's attention op is cudagraph_unsafe: captured pieces between them need graph partitions
        import torch._inductor.config as inductor_config

        inductor_config.graph_partition = True
    writer.header["eager_reason"] = compile_decode(engine, progress, **options)


def _measure_context(engine, model, shape, ids, context, policies, budgets, decode_steps, progress,
                     target: BenchTarget, writer: RowWriter, options: StepOptions) -> None:
    """One context: prefill under `full`, then each policy over the same cache, then hf-offload."""
    fixed = engine.config.with_changes(policy="full", budget=budgets[0])
    progress(f"{shape.name}: prefill {context} tokens (full cache on the compute device)")
    engine.reset()
    engine.configure(fixed)
    engine.prefill(ids[:context])
    runs = [(p, b) for p in policies if p != "hf-offload" for b in (budgets if p == "infinigen" else budgets[:1])]
    for policy, budget in runs:
        engine.configure(fixed.with_changes(policy=policy, budget=budget))  # the host pool if not full
        engine.truncate(context)
        engine.prepare(decode_steps + 1)
        engine.decode(ids[context])  # warm-up step, not timed
        engine.truncate(context)
        if target.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step_ms, fetched, wait_ms, host_work = _decode_ms(engine, ids[context : context + decode_steps], target.device)
        writer.add({**_row(shape.name, context, policy, budget, step_ms, fetched / decode_steps, wait_ms, target),
                    **host_work, "fetch": _fetch_label(engine) if policy == "infinigen" else None,
                    "step": engine.decode_step.label})
        progress(f"  {policy} (budget {budget}): {writer.rows[-1]['ms_per_token']:.1f} ms/token")
        if options.trace is not None and budget == budgets[0]:
            engine.truncate(context)
            engine.prepare(TRACED_STEPS + 2)
            _trace_steps(engine, ids[context : context + TRACED_STEPS + 1], target.device,
                         options.trace / f"{_slug(shape.name)}-{context}-{policy}", writer.rows[-1]["ms_per_token"])
            progress(f"  {TRACED_STEPS} consecutive {policy} steps profiled: {options.trace}")
    engine.truncate(0)
    if "hf-offload" in policies:
        engine.configure(fixed)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step_ms = _hf_offload_ms(model, ids, context, decode_steps)
        writer.add(_row(shape.name, context, "hf-offload", None, step_ms, None, None, target))
        progress(f"  hf-offload: {writer.rows[-1]['ms_per_token']:.1f} ms/token")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


TRACED_STEPS = 3  # profiled one after another, timed as the rows' steps are, after one warm-up step under the profiler


def _trace_steps(engine, tokens: Sequence[int], device: str, stem: Path, timed_ms: float) -> None:
    """Consecutive decode steps under torch.profiler (a schedule: the first a warm-up, the rest recorded, each
    synchronized and timed as `_decode_ms` times them, each labelled "decode step N"): `stem`.json.gz (a Chrome
    trace) and `stem`.txt (each step's time beside the row's timed median `timed_ms`, then the top ops by the
    device's and the host's own time). Steps that run longer timed than traced show up as a gap here."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    stem.parent.mkdir(parents=True, exist_ok=True)
    traced_ms: list[float] = []
    recorded = []

    def keep(profiler) -> None:  # the schedule hands over the recorded steps when the last one ends
        profiler.export_chrome_trace(str(stem.with_suffix(".json.gz")))  # the profiler packs a .gz path itself
        recorded.append(profiler.key_averages())

    plan = schedule(wait=0, warmup=1, active=len(tokens) - 1)
    with profile(activities=activities, schedule=plan, on_trace_ready=keep) as profiler:
        for number, token in enumerate(tokens):
            _synchronize(device)
            started = time.perf_counter()
            with record_function(f"decode step {number}"):
                engine.decode(int(token))
            _synchronize(device)
            traced_ms.append((time.perf_counter() - started) * 1e3)
            profiler.step()
    averages = recorded[0]
    sorts = (["self_device_time_total"] if device == "cuda" else []) + ["self_cpu_time_total"]
    steps = ", ".join(f"{ms:.1f}" for ms in traced_ms[1:])
    header = (f"{len(traced_ms) - 1} consecutive steps recorded (after 1 warm-up): {steps} ms each under the "
              f"profiler; the row's timed median: {timed_ms:.1f} ms")
    tables = [f"sorted by {key}\n{averages.table(sort_by=key, row_limit=40)}" for key in sorts]
    stem.with_suffix(".txt").write_text("\n\n".join([header, *tables]) + "\n", encoding="utf-8")


def _fetch_label(engine) -> str:
    """How the selected rows reached the compute side: in place (zero_copy.py) or staged (and why)."""
    reason = getattr(engine.fetcher, "zero_copy_reason", "the pool is on the compute device")
    return "zero-copy" if reason is None else f"staged ({reason})"


def _row(model: str, context: int, policy: str, budget, step_ms, bytes_per_token, wait_ms,
         target: BenchTarget) -> dict:
    ms = statistics.median(step_ms)
    peak = target.peak_h2d_gbps
    return {"model": model, "context": context, "policy": policy, "budget": budget if policy == "infinigen" else None,
            "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "bytes_fetched_per_token": bytes_per_token,
            "fetch_wait_ms_per_step": wait_ms,
            "h2d_gbps": bytes_per_token / (ms / 1e3) / 1e9 if bytes_per_token and policy != "full" else None,
            "peak_h2d_gbps": peak, "peak_gpu_bytes": torch.cuda.max_memory_allocated() if target.device == "cuda" else None}


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_offload, speedup_vs_hf_offload and ratio_to_full, each within the same model and context."""
    for row in rows:
        same = {r["policy"]: r for r in rows if r["model"] == row["model"] and r["context"] == row["context"]
                and r["policy"] != "infinigen"}
        for key, policy in (("speedup_vs_offload", "offload"), ("speedup_vs_hf_offload", "hf-offload"),
                            ("ratio_to_full", "full")):
            other = same.get(policy)
            row[key] = row["tokens_per_s"] / other["tokens_per_s"] if other else None
