"""What crosses to the compute device per decode step, with and without what the device keeps (resident.py).

    INFINIGEN_SEPARATE_DEVICES=1 python scripts/device_keeping.py                 # a random-weight tiny Llama
    INFINIGEN_SEPARATE_DEVICES=1 python scripts/device_keeping.py --real --context 1024 --text ../shared/data/haystack

Runs one conversation three times on the CPU under CUDA's rules (infinigen_core/devices.py): the dense
layers fetched whole each step (as before), kept on the device (the default), and kept with the cache of
selected rows. Prints per setting the K/V bytes fetched per step, the cache's plan bytes, its hits, and the
largest logit difference from the first setting (the outputs must not change). With --real: the default
model (SmolLM2-135M) on real text, where the hit rate means something; random weights only check the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infinigen_core.config import EngineConfig  # noqa: E402
from infinigen_core.devices import SEPARATE_DEVICES_ENV, SeparateDevicesMode  # noqa: E402


def tiny_engine(config: EngineConfig, context: int):
    from bench.gpu import SHAPES, random_llama
    from infinigen_core.calibration import calibrate
    from infinigen_core.engine import InfiniGenEngine

    torch.manual_seed(0)
    model = random_llama(SHAPES["tiny"], context + 64, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, SHAPES["tiny"].vocab, (context + 32,)).tolist()
    return InfiniGenEngine(model, None, config, skew_set=calibrate(model, ids[:256])), ids


def real_engine(config: EngineConfig, context: int, text: Path):
    from infinigen_core.loading import load_engine

    engine = load_engine(device="cpu", config=config, progress=lambda message: None)
    source = "\n".join(p.read_text(encoding="utf-8") for p in sorted(text.glob("*.txt"))) if text.is_dir() \
        else text.read_text(encoding="utf-8")
    return engine, engine.tokenizer(source)["input_ids"][: context + 32]


def run(settings: dict, args) -> dict:
    config = EngineConfig(policy="infinigen", budget=args.budget, min_fetch_tokens=0, dense_under_budget=False,
                          **settings)
    with SeparateDevicesMode():
        engine, ids = real_engine(config, args.context, args.text) if args.real else tiny_engine(config, args.context)
        with engine:
            engine.prefill(ids[: args.context])
            fetched, plans = engine.fetcher.bytes_fetched, engine.fetcher.plan_bytes
            logits = torch.stack([engine.decode(token) for token in ids[args.context : args.context + args.steps]])
            cache = engine.fetcher.cache
            return {"settings": settings, "bytes_per_step": (engine.fetcher.bytes_fetched - fetched) / args.steps,
                    "plan_bytes_per_step": (engine.fetcher.plan_bytes - plans) / args.steps,
                    "cache_hits": cache.hits, "cache_lookups": cache.lookups, "logits": logits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="the default model on --text (else a random tiny Llama)")
    parser.add_argument("--text", type=Path, help="with --real: a UTF-8 file or a directory of .txt files")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--cache-rows", type=int, default=512, help="selected_rows_cache of the third run")
    args = parser.parse_args()
    if os.environ.get(SEPARATE_DEVICES_ENV) != "1":
        parser.error(f"set {SEPARATE_DEVICES_ENV}=1: the pool must be in (emulated) host memory")
    if args.real and args.text is None:
        parser.error("--real needs --text")
    runs = [run(settings, args) for settings in
            ({"dense_layers_on_device": False}, {}, {"selected_rows_cache": args.cache_rows})]
    reference = runs[0]["logits"]
    for result in runs:
        result["max_logit_difference"] = float((result.pop("logits") - reference).abs().max())
    for result in runs:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
