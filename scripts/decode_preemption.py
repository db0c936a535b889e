"""What another process's short bursts of work cost a decode step that runs one thread per core: the default
model's ms per token decoded alone and beside a process that is busy for BUSY ms of every PERIOD ms (a
browser's renderer waking to draw, roughly), rounds interleaved. On a 2-core machine a burst that takes a core
from one of the two decode threads holds up the other at the end of every parallel op until it is back, so
the step loses about the burst's whole length, not half of it.

usage: python scripts/decode_preemption.py [--rounds 4] [--tokens 64] [--busy 2] [--period 16]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from infinigen_core.loading import load_engine  # noqa: E402

BURSTS = """
import sys, time
busy, period = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < busy:
        pass
    time.sleep(period - busy)
"""


def ms_per_token(engine, prompt: list[int], tokens: int) -> float:
    """Median ms of `tokens` greedy decode steps after `prompt` (the first two left out)."""
    engine.reset()
    engine.prefill(prompt)
    token, times = prompt[-1], []
    for _ in range(tokens):
        started = time.perf_counter()
        token = int(engine.decode(token).reshape(-1).argmax())
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--busy", type=float, default=2.0, help="ms of work per burst")
    parser.add_argument("--period", type=float, default=16.0, help="ms from one burst to the next")
    args = parser.parse_args()
    if not 0 < args.busy < args.period:
        parser.error("--busy must be above 0 and below --period")
    engine = load_engine()
    prompt = list(range(1000, 1040))
    ms_per_token(engine, prompt, 8)  # warm-up
    alone, beside = [], []
    for number in range(1, args.rounds + 1):
        alone.append(ms_per_token(engine, prompt, args.tokens))
        bursts = subprocess.Popen([sys.executable, "-c", BURSTS, str(args.busy), str(args.period)])
        try:
            time.sleep(0.3)
            beside.append(ms_per_token(engine, prompt, args.tokens))
        finally:
            bursts.kill()
            bursts.wait()
        print(f"round {number}: alone {alone[-1]:.2f} ms, beside the bursts {beside[-1]:.2f} ms", flush=True)
    quiet, loaded = statistics.median(alone), statistics.median(beside)
    share, threads = args.busy / args.period, torch.get_num_threads()
    print(f"median: alone {quiet:.2f} ms, beside {loaded:.2f} ms per token: {loaded / quiet:.3f}x, with the bursts "
          f"taking {share:.1%} of one core (if the {threads} decode threads shared the loss evenly: "
          f"{threads / (threads - share):.3f}x)")


if __name__ == "__main__":
    main()
