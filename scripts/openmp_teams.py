"""What another thread's torch work costs the model's thread: small products (a decode step's kind) timed on a
"model" thread before and after a second, still-living thread runs one large op, with the second thread left
as torch starts it (`plain`) and confined to itself (`confined`, chat_service/torch_threads.py). Rounds
interleaved.

usage: python scripts/openmp_teams.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chat_service.torch_threads import openmp_runtime, run_alone  # noqa: E402


def small_products_us(vector: torch.Tensor, matrix: torch.Tensor, count: int = 3000) -> float:
    started = time.perf_counter()
    for _ in range(count):
        (vector @ matrix).relu_()
    return (time.perf_counter() - started) / count * 1e6


def one_round(confined: bool) -> tuple[float, float]:
    """(us per product before, after) the other thread's op."""
    vector, matrix = torch.randn(1, 576), torch.randn(576, 4096)
    other_done, finish = threading.Event(), threading.Event()
    times: list[float] = []

    def model() -> None:
        times.append(small_products_us(vector, matrix))
        worker.start()
        other_done.wait()
        times.append(small_products_us(vector, matrix))
        finish.set()

    def other() -> None:
        if confined:
            runtime = openmp_runtime()
            assert runtime is not None, "torch runs without OpenMP here: nothing to measure"
            run_alone(runtime)
        (torch.randn(3_000_000) * 2).sum()
        other_done.set()
        finish.wait()  # alive while the model thread is timed, as a web server's worker thread is

    worker = threading.Thread(target=other, name="web-worker")
    runner = threading.Thread(target=model, name="model")
    runner.start()
    runner.join()
    worker.join()
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OpenMP {torch.backends.openmp.is_available()}")
    ratios: dict[str, list[float]] = {"plain": [], "confined": []}
    for _ in range(args.rounds):
        for name in ratios:
            before, after = one_round(confined=name == "confined")
            ratios[name].append(after / before)
            print(f"{name:8s} small product {before:6.0f} us before, {after:6.0f} us after ({after / before:.2f}x)")
    for name, values in ratios.items():
        print(f"median after/before, {name}: {statistics.median(values):.2f}x")


if __name__ == "__main__":
    main()
