"""GPU decode speed of full / offload / InfiniGen on Llama-2-7B- and Llama-3-8B-shaped models.

    python -m infinigen_core.eval gpu --models llama2-7b,llama3-8b --context 4096,8192,16384,32768

Weights are random (fp16, allocated straight on the GPU from a meta-device skeleton): speed does not
depend on their values, and InfiniGen's budget is fixed (alpha so large that the budget cap always
binds), so every step fetches the same share of the cache. The pool sits in pinned host memory for
offload and infinigen; `full` keeps the whole cache on the GPU. The peak host-to-device bandwidth is
measured with a pinned copy and the achieved rate (bytes fetched per token / time per token) is
reported against it. Without a CUDA device it prints so and exits 0.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import EngineConfig
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
    """A Llama of this shape with random weights, allocated on `device` without a CPU copy first."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                         max_position_embeddings=max_context + 64, rope_theta=shape.rope_theta)
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


def _decode_ms(engine, tokens: Sequence[int]) -> tuple[list[float], int]:
    fetched_before = engine.fetcher.bytes_fetched
    step_ms = []
    for token in tokens:
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.decode(int(token))
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - started) * 1e3)
    return step_ms, engine.fetcher.bytes_fetched - fetched_before


def gpu_benchmark(shape_names: Sequence[str], contexts: Sequence[int], policies: Sequence[str], budget: float,
                  decode_steps: int, progress=print) -> dict:
    """Rows per (model, context, policy): tokens_per_s, ms_per_token, ratio_to_offload, bytes per token, bandwidth."""
    from ..calibration import calibrate
    from ..engine import InfiniGenEngine

    if not torch.cuda.is_available():
        return {"cuda": False, "message": NO_CUDA_MESSAGE, "rows": []}
    peak = peak_h2d_gbps()
    progress(f"peak pinned host-to-device copy: {peak:.1f} GB/s")
    rows = []
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        progress(f"building {shape.name} with random fp16 weights on {torch.cuda.get_device_name(0)}")
        model = random_llama(shape, max(contexts))
        generator = torch.Generator().manual_seed(0)
        skew = calibrate(model, torch.randint(0, shape.vocab, (256,), generator=generator).tolist(), "cuda")
        fixed = EngineConfig(policy="full", alpha=1e6, budget=budget, prefill_chunk=1024, history_steps=8)
        engine = InfiniGenEngine(model, None, fixed, skew_set=skew, device="cuda", fingerprint=shape_name)
        try:
            for context in contexts:
                ids = torch.randint(0, shape.vocab, (context + decode_steps + 1,), generator=generator).tolist()
                progress(f"{shape.name}: prefill {context} tokens (full cache on the GPU)")
                engine.reset()
                engine.configure(fixed)
                engine.prefill(ids[:context])
                for policy in policies:
                    engine.configure(fixed.with_changes(policy=policy))  # moves the pool to pinned host memory
                    torch.cuda.reset_peak_memory_stats()
                    engine.truncate(context)
                    engine.decode(ids[context])  # warm-up step, not timed
                    engine.truncate(context)
                    step_ms, fetched = _decode_ms(engine, ids[context : context + decode_steps])
                    ms = statistics.median(step_ms)
                    per_token = fetched / decode_steps
                    rows.append({"model": shape.name, "context": context, "policy": policy, "ms_per_token": ms,
                                 "tokens_per_s": 1e3 / ms, "bytes_fetched_per_token": per_token,
                                 "h2d_gbps": per_token / (ms / 1e3) / 1e9 if policy != "full" else None,
                                 "peak_h2d_gbps": peak, "peak_gpu_bytes": torch.cuda.max_memory_allocated()})
                    progress(f"  {policy}: {ms:.1f} ms/token, {per_token / 2**20:.1f} MiB fetched per token")
                engine.truncate(0)
        finally:
            engine.close()
            del engine, model
            torch.cuda.empty_cache()
    for row in rows:
        offload = next((r for r in rows if r["model"] == row["model"] and r["context"] == row["context"]
                        and r["policy"] == "offload"), None)
        row["speedup_vs_offload"] = row["tokens_per_s"] / offload["tokens_per_s"] if offload else None
    return {"cuda": True, "device": torch.cuda.get_device_name(0), "peak_h2d_gbps": peak, "rows": rows}
