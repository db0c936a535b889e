"""Which ops of the engine's one-token forward would break a CUDA graph's replay, per policy, found on the CPU.

Runs the GPU's code paths under INFINIGEN_SEPARATE_DEVICES=1 (the pool in emulated host memory), records two
consecutive decode steps' forwards (the part a capture would hold: the model's call, not the host work around it)
within one pool capacity, and lists where they part (bench/capture_rules.py: ops, shape, scalar, storage). An
empty list for a policy means its step could be captured as it is; docs/CAPTURE.md is the plan that gets there.

    python scripts/capture_check.py [--policies full,offload,infinigen] [--context 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.capture_rules import StepRecorder, differences, summary  # noqa: E402
from bench.gpu import SHAPES, bench_config, random_llama  # noqa: E402
from infinigen_core import InfiniGenEngine  # noqa: E402
from infinigen_core.calibration import calibrate  # noqa: E402
from infinigen_core.devices import SEPARATE_DEVICES_ENV, SeparateDevicesMode  # noqa: E402


@dataclass
class Recorded:
    steps: list[list]  # per decode forward, its ops (bench/capture_rules.py)
    copies_to_host: float  # per step: copies the step sent towards the host (fetch.HostChannel)
    worker_handoffs: float  # per step: calls handed to the fetch worker thread


def recorded_steps(policy: str, context: int, steps: int = 2) -> Recorded:
    """`steps` consecutive decode forwards of `policy` over a `context`-token pool (tiny Llama shape, fixed seeds)."""
    shape = SHAPES["tiny"]
    generator = torch.Generator().manual_seed(0)
    # for this engine only (the environment and the global RNG as they were after): the pool and the compute
    # side kept apart
    with mock.patch.dict(os.environ, {SEPARATE_DEVICES_ENV: "1"}), torch.random.fork_rng(), SeparateDevicesMode():
        torch.manual_seed(0)  # the random weights
        model = random_llama(shape, context + steps + 8, "cpu", torch.float32)
        skew = calibrate(model, torch.randint(0, shape.vocab, (256,), generator=generator).tolist(), "cpu")
        engine = InfiniGenEngine(model, None, bench_config(0.15).with_changes(policy=policy), skew_set=skew,
                                 device="cpu", fingerprint="tiny")
        try:
            ids = torch.randint(0, shape.vocab, (context + steps + 2,), generator=generator).tolist()
            engine.prefill(ids[:context])
            engine.prepare(steps + 2)  # every recorded step within one capacity
            engine.decode(ids[context])  # warm-up: state made lazily by a first step
            recorders: list[StepRecorder] = []  # kept alive until every step is recorded (capture_rules.py)
            forward, fetcher = engine.decode_step, engine.fetcher

            def recording_forward(**inputs):
                recorders.append(StepRecorder())
                with recorders[-1]:
                    return forward(**inputs)

            def noted(name, method):  # work on another thread, launched from the step's on a GPU
                def call(*args):
                    if recorders:
                        recorders[-1].note(name, *args)
                    return method(*args)
                return call

            ops = getattr(fetcher, "ops", None)
            if ops is not None:
                ops.scatter, ops.gather = noted("ops.scatter", ops.scatter), noted("ops.gather", ops.gather)
            engine.decode_step = recording_forward
            copies, calls = fetcher.host.copies, getattr(fetcher, "worker_calls", 0)
            for token in ids[context + 1 : context + 1 + steps]:
                engine.decode(token)
            return Recorded([recorder.ops for recorder in recorders], (fetcher.host.copies - copies) / steps,
                            (getattr(fetcher, "worker_calls", 0) - calls) / steps)
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="full,offload,infinigen")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = {}
    for policy in args.policies.split(","):
        recorded = recorded_steps(policy, args.context)
        first, second = recorded.steps
        kinds = summary(differences(first, second))
        report[policy] = {"ops_per_step": len(first), "differing_ops": sum(sum(c.values()) for c in kinds.values()),
                          "by_kind": {kind: dict(counts.most_common()) for kind, counts in kinds.items()},
                          "copies_to_host_per_step": recorded.copies_to_host,
                          "worker_handoffs_per_step": recorded.worker_handoffs}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for policy, row in report.items():
        print(f"{policy}: {row['ops_per_step']} ops per forward, {row['differing_ops']} would not replay; per step "
              f"{row['copies_to_host_per_step']:g} copies to the host, {row['worker_handoffs_per_step']:g} hand-offs "
              "to the fetch worker")
        for kind, counts in row["by_kind"].items():
            print(f"  {kind}: " + ", ".join(f"{name} x{count}" for name, count in counts.items()))


if __name__ == "__main__":
    main()
