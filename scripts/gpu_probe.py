"""Measure on a real card the rates the GPU predictor (bench/gpu_predict.py) otherwise states.

    python3 scripts/gpu_probe.py --save $OUT/gpu-probe.json
    python3 -m bench gpu --predict --device-profile $OUT/gpu-probe.json

Parts, each written to --save as soon as it is done (a call cut short keeps the parts before):
- `link`: pinned host-to-device and device-to-host peaks, and both directions at once;
- `host_gather`: the CPU gathering InfiniGen's selected rows from a pinned pool into pinned staging
  (`index_select(out=)`, what the fetch worker does) with Llama-3-8B and Llama-2-7B shapes at 32k, budget
  0.15, at 1, 2, 4, 8 and 16 threads;
- `zero_copy`: a Triton kernel on the GPU gathering the same rows straight from the pinned pool, rows of
  256 bytes (a comparison);
- `mapped_gather`: the engine's own zero-copy fetch (zero_copy.py: torch's `index_select` over a CUDA view
  of the pinned pool, `CudaOps.mapped`, on a side stream), the scattered-read rate the predictor takes as
  `zero_copy_gather_gbps`: keys and values of one layer's selected rows, Llama-3-8B and Llama-2-7B shapes
  at 32k, budgets 0.15 and 0.1;
- `launch_floor`: plain transformers' decode step of a random Llama-3-8B-shaped model at 16k, eager and
  captured (`torch.compile(mode="reduce-overhead")`, a static cache).

`rates` holds what the predictor takes (pinned_h2d_gbps, pinned_d2h_gbps, host_gather_gbps,
zero_copy_gather_gbps, host_ms_per_layer); the rest is kept for the comparison. Without CUDA it refuses and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NO_CUDA = "gpu_probe needs a CUDA device: nothing was measured"
ROW_SHAPES = {"llama3-8b": (8, 128), "llama2-7b": (32, 128)}  # KV heads, head_dim
THREADS = (1, 2, 4, 8, 16)


def best_gbps(run, nbytes: int, repeats: int = 5) -> float:
    """The best of `repeats` timed calls of `run` (which must leave no work in flight), in GB/s."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def selected_rows(kv_heads: int, context: int, budget: float, seed: int = 0) -> torch.Tensor:
    """Flat row indices of a [kv_heads * context, dim] layer for `budget` x context random slots per head,
    in the random (rank) order the engine gathers them in."""
    generator = torch.Generator().manual_seed(seed)
    k = int(budget * context)
    slots = torch.stack([torch.randperm(context, generator=generator)[:k] for _ in range(kv_heads)])
    return (slots + torch.arange(kv_heads).unsqueeze(1) * context).view(-1)


def measure_host_gather(kv_heads: int, head_dim: int, context: int, budget: float, threads: int,
                        pin: bool, dtype: torch.dtype = torch.float16) -> float:
    """GB/s of gathering the selected rows of one layer's keys into staging, as the fetch worker does."""
    pool = torch.randn(kv_heads * context, head_dim).to(dtype)
    rows = selected_rows(kv_heads, context, budget)
    staging = torch.empty(rows.numel(), head_dim, dtype=dtype)
    if pin:
        pool, staging = pool.pin_memory(), staging.pin_memory()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rate = best_gbps(lambda: torch.index_select(pool, 0, rows, out=staging), staging.numel() * staging.element_size())
    finally:
        torch.set_num_threads(before)
    if not torch.equal(staging, pool[rows]):
        raise AssertionError("the gather did not return the selected rows")
    return rate


def measure_link(megabytes: int = 1024) -> dict:
    host = torch.empty(megabytes * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    back = torch.empty_like(host, pin_memory=True)
    other = torch.cuda.Stream()

    def h2d():
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h():
        back.copy_(device, non_blocking=True)
        torch.cuda.synchronize()

    def both():
        device.copy_(host, non_blocking=True)
        with torch.cuda.stream(other):
            back.copy_(device, non_blocking=True)
        torch.cuda.synchronize()

    size = host.numel()
    return {"pinned_h2d_gbps": best_gbps(h2d, size), "pinned_d2h_gbps": best_gbps(d2h, size),
            "duplex_gbps": best_gbps(both, 2 * size)}


def measure_gathers(context: int = 32768, budget: float = 0.15) -> dict:
    table = {}
    for name, (heads, dim) in ROW_SHAPES.items():
        table[name] = {str(n): measure_host_gather(heads, dim, context, budget, n, pin=True) for n in THREADS}
    return table


_KERNEL = None


def _zero_copy_kernel():
    global _KERNEL  # built once, at first use: Triton compiles on the card
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gather_rows(src, index, dst, ROW: tl.constexpr):
            program = tl.program_id(0)
            row = tl.load(index + program).to(tl.int64)
            columns = tl.arange(0, ROW)
            tl.store(dst + program * ROW + columns, tl.load(src + row * ROW + columns))

        _KERNEL = gather_rows
    return _KERNEL


class _MappedHost:
    """A pinned host tensor handed to Triton by its address: with unified addressing, pinned memory is
    mapped into the GPU's address space at the same address."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.dtype = tensor, tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def measure_zero_copy(context: int = 32768, budget: float = 0.15) -> dict:
    heads, dim = ROW_SHAPES["llama3-8b"]
    pool = torch.randn(heads * context, dim).half().pin_memory()
    rows = selected_rows(heads, context, budget).cuda()
    out = torch.empty(rows.numel(), dim, dtype=torch.float16, device="cuda")
    kernel = _zero_copy_kernel()

    def run():
        kernel[(rows.numel(),)](_MappedHost(pool), rows, out, ROW=dim)
        torch.cuda.synchronize()

    run()
    if not torch.equal(out.cpu(), pool[rows.cpu()]):
        raise AssertionError("the zero-copy gather did not return the selected rows")
    return {"llama3-8b_gbps": best_gbps(run, out.numel() * out.element_size())}


def measure_mapped_gather(ops, kv_heads: int, head_dim: int, context: int, budget: float,
                          dtype: torch.dtype = torch.float16, repeats: int = 5) -> float:
    """GB/s of the engine's zero-copy fetch (`ops` a transfer.DeviceOps: CudaOps on a card): one layer's
    selected key and value rows gathered through mapped views of host memory on a side stream, the compute
    side waiting on its event; checked against the host's own gather first."""
    generator = torch.Generator().manual_seed(0)
    pools = []
    for _ in range(2):  # keys, values
        pool = ops.host_empty((kv_heads * context, head_dim), dtype)
        pool.copy_(torch.randn(kv_heads * context, head_dim, generator=generator).to(dtype))
        pools.append(pool)
    rows_host = selected_rows(kv_heads, context, budget)
    rows = rows_host.to(ops.device)
    stream = ops.stream()
    views = [ops.mapped(pool) for pool in pools]
    outs = [ops.empty((rows.numel(), head_dim), dtype, stream) for _ in pools]

    def run():
        ops.follow(stream)
        for view, out in zip(views, outs):
            ops.gather(stream, view, rows, out)
        ready = ops.record(stream)
        ops.wait(ready, *outs)
        ready.synchronize()

    run()
    for pool, out in zip(pools, outs):
        if not torch.equal(out.cpu(), pool.index_select(0, rows_host)):
            raise AssertionError("the mapped gather did not return the selected rows")
    return best_gbps(run, sum(out.numel() * out.element_size() for out in outs), repeats)


def measure_mapped_gathers(context: int = 32768) -> dict:
    from infinigen_core.transfer import CudaOps

    ops = CudaOps("cuda")
    return {f"{name}@{budget}": measure_mapped_gather(ops, heads, dim, context, budget)
            for name, (heads, dim) in ROW_SHAPES.items() for budget in (0.15, 0.1)}


def measure_launch_floor(context: int = 16384, steps: int = 8) -> dict:
    from transformers import StaticCache

    from bench.gpu import SHAPES, random_llama

    model = random_llama(SHAPES["llama3-8b"], context + steps + 8)
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")

    def step_ms(forward) -> float:
        times = []
        for offset in range(steps + 3):
            position = torch.tensor([context + offset], device="cuda")
            torch.cuda.synchronize()
            started = time.perf_counter()
            forward(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times[3:])  # the first steps warm up (and capture)

    with torch.inference_mode():
        eager = step_ms(model)
        captured = step_ms(torch.compile(model, mode="reduce-overhead", fullgraph=True))
    layers = model.config.num_hidden_layers
    return {"eager_full_ms": eager, "captured_full_ms": captured, "layers": layers,
            "host_ms_per_layer": eager / layers}


def probe(save: Path | None) -> dict:
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rates": {}, "errors": {}}
    parts = [("link", measure_link), ("host_gather", measure_gathers), ("zero_copy", measure_zero_copy),
             ("mapped_gather", measure_mapped_gathers), ("launch_floor", measure_launch_floor)]
    for name, measure in parts:
        print(f"measuring {name}...", flush=True)
        try:
            result[name] = measure()
        except Exception as error:  # one part failing (no Triton, an API change) must not lose the others
            result["errors"][name] = f"{type(error).__name__}: {error}"
        _rates(result)
        if save is not None:
            save.parent.mkdir(parents=True, exist_ok=True)
            save.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps({name: result.get(name), "error": result["errors"].get(name)}), flush=True)
    return result


def _rates(result: dict) -> None:
    rates = result["rates"]
    if "link" in result:
        rates["pinned_h2d_gbps"] = result["link"]["pinned_h2d_gbps"]
        rates["pinned_d2h_gbps"] = result["link"]["pinned_d2h_gbps"]
    if "host_gather" in result:
        rates["host_gather_gbps"] = max(result["host_gather"]["llama3-8b"].values())
    if "mapped_gather" in result:
        rates["zero_copy_gather_gbps"] = result["mapped_gather"]["llama3-8b@0.15"]
    if "launch_floor" in result:
        rates["host_ms_per_layer"] = result["launch_floor"]["host_ms_per_layer"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="write the measured rates (JSON) here, part by part")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    probe(args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
