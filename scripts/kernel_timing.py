"""Milliseconds per decode step that InfiniGen's two CPU kernels take at a model's long-context shapes, with
nothing else around them: `rehearse_select` over every sparse layer's int8 partial keys, and `attend_rows` over
the rows it would choose, placed at random in pools on huge pages as the engine's are (also: the same with the KV
heads sharing the budget, 2k slots named per head and a mask per head; the same number of rows side by side, a
dense layer's `attend_span`, and `encode_partial_keys` coding every past row's partial key of every sparse layer: a
restore's or a long prefill's batch). Random values: the times, not the choices, are the
point.
For changes to infinigen_cpu.cpp, run it for each build one after the other, alternating, a few times: the
machine's memory speed drifts from minute to minute.

    python scripts/kernel_timing.py [--shape smollm2-8k|gemma3-32k] [--repeats 30]

smollm2-8k: SmolLM2-135M at 8,100 tokens (28 sparse layers, 3 KV heads of 3 queries, 64 channels, 32 partial
channels, budget 0.15); gemma3-32k: Gemma 3 270M's 3 global layers at 32,700 tokens (1 KV head of 4 queries,
256 channels, all 256 partial, budget 0.1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from infinigen_core import cpu_kernels  # noqa: E402
from infinigen_core.huge_pages import advise_huge_pages  # noqa: E402
from infinigen_core.loading import default_cache_dir  # noqa: E402
from infinigen_core.policies import partial_codes  # noqa: E402

# layers, KV heads, query group, head channels, partial channels, past tokens, budget
SHAPES = {"smollm2-8k": (28, 3, 3, 64, 32, 8100, 0.15), "gemma3-32k": (3, 1, 4, 256, 256, 32700, 0.1)}


def pool_layer(kv: int, slots: int, dim: int) -> torch.Tensor:
    rows = torch.empty(kv, slots, dim)
    advise_huge_pages(rows)
    return rows.normal_()


def milliseconds(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-8k")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    kernels, why = cpu_kernels.build(default_cache_dir() / "kernels")
    if kernels is None:
        raise SystemExit(f"the CPU kernels did not build: {why}")
    layers, kv, group, dim, r, past, budget = SHAPES[args.shape]
    k, slots = int(budget * past), past + 64
    torch.manual_seed(0)
    keys = [pool_layer(kv, slots, dim) for _ in range(layers)]
    values = [pool_layer(kv, slots, dim) for _ in range(layers)]
    query, partial_query = torch.randn(kv, group, dim), torch.randn(kv, group, r)
    # the cache as the policy holds it: int8 codes and each slot's exponent row, channel-major [kv, r + 1, slots]
    partial_keys = [partial_codes.encode(torch.randn(kv, slots, r)).transpose(1, 2).contiguous() for _ in range(layers)]
    new_slot = torch.full((kv, 1), past)
    chosen = [torch.cat([new_slot, torch.stack([torch.randperm(past)[:k] for _ in range(kv)])], 1) for _ in keys]
    side_by_side = torch.cat([new_slot, torch.arange(k).expand(kv, -1)], 1)
    scale = dim ** -0.5

    def select(width: int):
        def step():
            for layer in range(layers):
                kernels.rehearse_select(partial_query, partial_keys[layer], past, k, 12.0, width)
        return step

    # the heads sharing the budget: 2k slots named per head, uneven counts (kv x k in all) in a mask per head
    shares = [round(k * share) for share in (0.5, 1.5, 1.0)[:kv]]
    shares[-1] += kv * k - sum(shares)
    wide = [torch.cat([new_slot, torch.stack([torch.randperm(past)[:2 * k] for _ in range(kv)])], 1) for _ in keys]
    per_head_mask = torch.arange(2 * k + 1).view(1, -1) <= torch.tensor(shares).view(-1, 1)

    def attend(rows, mask=None):
        def step():
            for layer in range(layers):
                kernels.attend_rows(query, keys[layer][:, : past + 1], values[layer][:, : past + 1], rows(layer), mask,
                                    scale)
        return step

    def dense():
        kernels.attend_span(query, keys[0], values[0], 0, past + 1, scale)

    float_partial = [torch.randn(kv, past, r) for _ in range(layers)]
    past_slots = torch.arange(past)

    def encode():
        for layer in range(layers):
            torch.ops.infinigen_cpu.encode_partial_keys(float_partial[layer], partial_keys[layer], past_slots)

    print(f"{args.shape}, {torch.get_num_threads()} threads, {layers} layers, {k} of {past} rows each:")
    for name, step in (("rehearse_select", select(k)), ("rehearse_select, heads sharing", select(min(past, 2 * k))),
                       ("attend_rows, rows at random", attend(lambda layer: chosen[layer])),
                       ("attend_rows, a mask per head", attend(lambda layer: wide[layer], per_head_mask)),
                       ("attend_rows, rows side by side", attend(lambda layer: side_by_side)),
                       ("attend_span, one dense layer", dense), ("encode_partial_keys, all rows", encode)):
        print(f"  {name:32s} {milliseconds(step, args.repeats):8.3f} ms")


if __name__ == "__main__":
    main()
