"""How often each policy's greedy continuation matches the full cache's, token by token.

    python -m bench agree --text essays/ --context 2048 --new-tokens 64

Two views of one question. `agreement`: along full's greedy continuation (teacher forcing), the share
of steps where the policy's top token is full's token; one early slip does not spoil the rest.
`match_prefix`: free-running greedy decoding, how many tokens come out identical before the first
difference (what a chat user would see).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from infinigen_core import EngineConfig
from .common import EvalError, decode_tokens, load_prefix


def greedy_continuation(engine, config: EngineConfig, prefix: list[int], new_tokens: int) -> list[int]:
    load_prefix(engine, config, prefix[:-1])
    tokens, token = [], prefix[-1]
    for _ in range(new_tokens):
        token = int(engine.decode(token).argmax())
        tokens.append(token)
    return tokens


def matching_prefix(tokens: Sequence[int], expected: Sequence[int]) -> int:
    """How many of `tokens` equal `expected` before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))


def agreement(engine, prompts: Sequence[Sequence[int]], new_tokens: int, configs: dict[str, EngineConfig],
              progress=None) -> dict[str, dict]:
    """Per config: agreement (teacher-forced top-1 match with full), match_prefix (free-running), fetched_ratio."""
    if new_tokens < 1:
        raise EvalError(f"--new-tokens must be >= 1, got {new_tokens}")
    reference = EngineConfig(policy="full")
    per = {name: {"agree": [], "prefix": [], "fetched": []} for name in configs}
    for index, prompt in enumerate(prompts):
        prompt = list(prompt)
        if progress:
            progress(f"prompt {index + 1}/{len(prompts)}: full's greedy continuation ({new_tokens} tokens)")
        expected = greedy_continuation(engine, reference, prompt, new_tokens)
        for name, config in configs.items():
            if progress:
                progress(f"prompt {index + 1}/{len(prompts)}: {name}")
            load_prefix(engine, config, prompt[:-1])
            forced = decode_tokens(engine, [prompt[-1]] + expected[:-1])
            predicted = forced.logits.argmax(-1).tolist()
            per[name]["agree"].append(sum(p == e for p, e in zip(predicted, expected)) / new_tokens)
            per[name]["fetched"] += forced.fetched_ratios
            free = greedy_continuation(engine, config, prompt, new_tokens)
            per[name]["prefix"].append(matching_prefix(free, expected))
    engine.reset()
    return {
        name: {
            "agreement": statistics.fmean(p["agree"]),
            "match_prefix": statistics.fmean(p["prefix"]),
            "fetched_ratio": statistics.fmean(p["fetched"]),
            "new_tokens": new_tokens,
        }
        for name, p in per.items()
    }
