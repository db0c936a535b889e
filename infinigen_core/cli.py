"""`python -m infinigen_core generate ...`: one prompt through the engine, streamed to the terminal.

    python -m infinigen_core generate --chat --prompt "What is the capital of France?"
    python -m infinigen_core generate --prompt-file notes.txt --policy infinigen --budget 0.1 --json

Loading messages go to stderr; the generated text streams to stdout; with --json one JSON object
(text, prompt_tokens, new_tokens, fetched_ratio, ms_per_token, policy, ...) is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .arch import UnsupportedModelError
from .config import POLICY_NAMES, ConfigError, EngineConfig, SamplingConfig, parse_pool_limit, pool_limit_tokens
from .engine import ContextOverflowError
from .loading import ModelLoadError
from .model_flags import add_model_flags, add_setting_flags, engine_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infinigen_core", description="InfiniGen engine tools")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a continuation or a chat reply for one prompt")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this UTF-8 file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_model_flags(gen)
    gen.add_argument("--policy", default="infinigen", choices=POLICY_NAMES)
    add_setting_flags(gen)
    gen.add_argument("--pool-limit", default=None, help="cap on the host KV pool: tokens (8192) or bytes (64MiB)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--cache-dir", type=Path, default=None, help="model and skew cache (default: user cache)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the results last")
    return parser


def _settings(args) -> tuple[EngineConfig, tuple[str, ...], SamplingConfig]:
    """Validate every setting before anything is loaded, so bad input fails fast and cleanly."""
    parse_pool_limit(args.pool_limit)  # format check now; converted to tokens once the model is known
    engine_config, chosen = engine_settings(args, args.policy)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens,
                              seed=args.seed)
    return engine_config, chosen, sampling


def _read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read the prompt file {args.prompt_file}: {error}") from error
    if not text.strip():
        raise ConfigError("the prompt is empty: pass some text with --prompt or --prompt-file")
    return text


def run_generate(args) -> dict:
    from .generation import chat_token_ids, generate
    from .loading import load_engine

    engine_config, chosen, sampling = _settings(args)
    prompt = _read_prompt(args)
    engine = load_engine(args.model, device=args.device, config=engine_config, cache_dir=args.cache_dir,
                         quantize=args.quantize, weights=args.weights, compile_decode=args.compile_decode,
                         cpu_kernels=args.cpu_kernels, user_settings=chosen,
                         progress=lambda message: print(message, file=sys.stderr, flush=True))
    engine_config = engine.config  # the model family's defaults in what the user left unset
    if args.pool_limit:
        limit = pool_limit_tokens(args.pool_limit, engine.pool.bytes_per_token())
        engine.configure(engine_config.with_changes(pool_limit_tokens=limit))
    tokenizer = engine.tokenizer
    if args.chat:
        prompt_ids = chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
    if len(prompt_ids) + 1 > engine.max_context:
        raise ContextOverflowError(
            f"the prompt has {len(prompt_ids)} tokens but the model's window is {engine.max_context}: shorten it"
        )
    decode_steps, new_tokens, text, finish = {}, 0, "", None
    started = time.perf_counter()
    for event in generate(engine, prompt_ids, sampling):
        if event.stats is not None and event.stats.is_decode:
            decode_steps[event.stats.step] = event.stats
        if event.finish_reason is not None:
            finish, text = event.finish_reason, event.full_text
            break
        new_tokens += 1
        print(event.text, end="", flush=True)
    print(flush=True)
    wall_s = time.perf_counter() - started
    steps = list(decode_steps.values())
    return {
        "text": text,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "finish_reason": finish,
        "policy": engine_config.policy,
        "fetched_ratio": sum(s.fetched_ratio() for s in steps) / len(steps) if steps else None,
        "ms_per_token": sum(s.total_ms for s in steps) / len(steps) if steps else None,
        "wall_s": wall_s,
        "model": engine.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "weights": engine.weights,
        "decode": engine.decode_step.label,
        "kernels": engine.kernels.label if engine.kernels is not None else "eager InfiniGen ops",
        "layer_kinds": [engine.adapter.layer_kind(layer) for layer in range(engine.adapter.num_layers)],
        "settings": {"alpha": engine_config.alpha, "budget": engine_config.budget,
                     "budget_is_tokens": engine_config.budget_is_tokens,
                     "min_fetch_tokens": engine_config.min_fetch_tokens,
                     "partial_ratio": engine_config.partial_ratio, "pool_limit_tokens": engine.config.pool_limit_tokens},
        "family_defaults": _family_defaults(engine),
    }


def _family_defaults(engine) -> str | None:
    """What the model family's own defaults set, in words (None: the family has none)."""
    applied = getattr(engine, "family_defaults", None)
    return applied.describe() if applied is not None else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run_generate(args)
    except (ConfigError, ModelLoadError, UnsupportedModelError, ContextOverflowError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    return 0
