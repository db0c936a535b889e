"""The default model's decode step under two values of one engine setting, alternated in one process over one
prefilled pool (the machine's speed drifts from minute to minute: an A/B in one process, medians, says more than
two runs of `bench speed`).

    python scripts/setting_ab.py --setting budget_by_head [--context 8150] [--rounds 6] [--steps 24]

Each round configures the engine with the setting on, then off (the order alternating between rounds), decodes a
few warm-up steps, times `--steps` steps, and takes the pool back to the prompt. Text: the first files of
`--text` (a folder of .txt files), cut to `--context` tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infinigen_core.config import EngineConfig  # noqa: E402
from infinigen_core.loading import load_engine  # noqa: E402

WARM_UP_STEPS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", required=True, help="a True/False field of EngineConfig, e.g. budget_by_head")
    parser.add_argument("--text", type=Path, default=Path("../shared/data/haystack"))
    parser.add_argument("--context", type=int, default=8150)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    if not isinstance(getattr(EngineConfig(), args.setting, None), bool):
        raise SystemExit(f"{args.setting!r} is not a True/False setting of EngineConfig")
    engine = load_engine(None, device="cpu")
    files = sorted(args.text.glob("*.txt")) if args.text.is_dir() else [args.text]
    text = "".join(path.read_text(errors="ignore") for path in files[:8])
    ids = engine.tokenizer(text)["input_ids"][: args.context]
    engine.prefill(ids)
    timings: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(args.rounds):
        for value in ((True, False) if round_index % 2 else (False, True)):
            engine.configure(EngineConfig(**{args.setting: value}))
            for _ in range(WARM_UP_STEPS):
                engine.decode(ids[-1])
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.decode(ids[-1])
            timings[value].append((time.perf_counter() - started) / args.steps * 1e3)
            engine.truncate(len(ids))
        print(f"round {round_index + 1}: on {timings[True][-1]:.2f} ms, off {timings[False][-1]:.2f} ms", flush=True)
    on, off = statistics.median(timings[True]), statistics.median(timings[False])
    print(f"{args.setting} on {on:.2f} ms, off {off:.2f} ms per token at {len(ids)} tokens: {on / off:.3f}x")


if __name__ == "__main__":
    main()
