"""Decode and prefill speed per policy, as ratios measured in the same run.

    python -m bench speed --text essays/ --context 2048,4096,8192 --policies full,offload,infinigen

Per context: one prefill (dense, timed), then rounds in which every policy in turn decodes a few of the
text's next tokens from the same prefix, each round starting one policy later than the one before.
Interleaving the policies means a burst of load from another process slows them alike; the first step after
each switch is a warm-up and is not timed. The median
step time is reported (robust to such bursts) and its ratio to `full`'s. Two reference rows run plain
transformers over the same tokens: `transformers` (its own DynamicCache, no engine) and `hf-offload`
(`DynamicCache(offloading=True)`, what a transformers user picks to keep the cache off the GPU).
`POLICY+KIND` (`--weights-rows full+fp32,...`) is that policy with other decode weights (weights.py:
fp32, int8, int4, auto) in the same interleaved rounds, `POLICY+eager` that policy with its decode step
run eagerly where the engine compiled it (compiled.py), and `POLICY+nokernels` that policy on the eager ops
where the engine has the CPU kernels (cpu_kernels.py); the plain rows use the weights the model loaded with. `llama.cpp` (`--llama-python PATH`) is llama.cpp on the same GGUF and the same token ids, run by that
interpreter in a subprocess (bench/llama_peer.py, n_threads=2), after our rounds: its rounds cannot
interleave with ours. `peak_rss_bytes` is a process's peak resident memory: ours so far at the end of a
context (the model, the compiled step and the largest cache yet), llama.cpp's over its whole run. `prompt_tokens_per_s` is the prefill's; `ratio_to_llama_cpp` is a row's ms/token
over llama.cpp's. Every row also gives the aten operations of one decode step (kernel launches on a GPU),
how many of them read a device value back to the host (a stall each on a GPU) and the engine's copies to
the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from infinigen_core import EngineConfig
from .common import EvalError, decode_tokens, load_prefix, synchronize
from .llama_peer import peak_rss_bytes  # standard library only: the peer and we measure alike
from .opcount import OpCounter
from .weights import DecodeWeights

REFERENCE = "transformers"
HF_OFFLOAD = "hf-offload"
LLAMA_CPP = "llama.cpp"
WEIGHTS_SEPARATOR = "+"  # a row "POLICY+KIND" runs POLICY with those decode weights
EAGER = "eager"  # a row "POLICY+eager" runs POLICY with the weights as loaded and the decode step uncompiled
NO_KERNELS = "nokernels"  # a row "POLICY+nokernels" runs POLICY without the CPU kernels (cpu_kernels.py)
PEER_SCRIPT = Path(__file__).with_name("llama_peer.py")


def row_weights(name: str) -> tuple[str, str | None]:
    """A row name's (policy, decode weights): "full+fp32" -> ("full", "fp32"), "full" -> ("full", None)."""
    policy, _, kind = name.partition(WEIGHTS_SEPARATOR)
    return policy, kind or None


def tokens_needed(context: int, decode_tokens_n: int, rounds: int) -> int:
    """Tokens of text one context's run reads: the prefix, every round's steps, the counted step."""
    return context + decode_tokens_n + rounds + 2


def decode_speed(engine, ids: Sequence[int], context: int, configs: dict[str, EngineConfig], decode_tokens_n: int,
                 rounds: int = 2, reference: bool = True, progress=None) -> list[dict]:
    """Rows for one context: policy, ms_per_token (median), mean_ms, ratio_to_full, prefill_s, pool/device bytes."""
    needed = tokens_needed(context, decode_tokens_n, rounds)
    if len(ids) < needed:
        raise EvalError(f"{needed} tokens are needed for context {context}, the text has {len(ids)}")
    if decode_tokens_n < rounds:
        raise EvalError(f"--decode-tokens ({decode_tokens_n}) must be at least --rounds ({rounds})")
    per_round = decode_tokens_n // rounds
    if context + per_round + 2 > engine.max_context:
        raise EvalError(f"context {context} plus {per_round + 2} decode steps per round exceeds the model's window of "
                        f"{engine.max_context}: use a context of at most {engine.max_context - per_round - 2}")
    prefix = list(ids[:context])
    first = next(iter(configs.values()))
    kernels = engine.kernels
    weights = DecodeWeights(engine.model, kernels)
    if progress:
        progress(f"context {context}: prefill")
    engine.reset()
    prefill_s = load_prefix(engine, first, prefix)
    times = {name: [] for name in configs}
    splits = {name: [] for name in configs}  # where each step's time went (speculation, fetch, attention)
    facts = {}
    names = list(configs)
    for round_index in range(rounds):
        # each round starts with the next policy: the step that follows a switch of settings (caches cold, the
        # machine's clocks) is not always the same policy's, so no row carries that bias in every round
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            config = configs[name]
            if progress:
                progress(f"context {context}: round {round_index + 1}/{rounds}, {name}")
            kind = row_weights(name)[1]
            weights.use(None if kind in (EAGER, NO_KERNELS) else kind)
            engine.kernels = None if kind == NO_KERNELS else kernels  # applied by load_prefix's configure
            load_prefix(engine, config, prefix)
            engine.prepare(per_round + 2)  # as a reply does: no pool growth inside a timed step
            # each round decodes the same next tokens: the same work for every policy
            with torch.compiler.set_stance("force_eager") if kind == EAGER else contextlib.nullcontext():
                run = decode_tokens(engine, ids[context : context + per_round + 1])
            times[name] += run.step_ms[1:]
            splits[name] += [step.time_split_ms() for step in list(engine.history)[-per_round:]]
            if round_index == rounds - 1:  # the same in every round: counted once (the count is slow)
                step = engine.history[-1]
                facts[name] = {"fetched_ratio": run.fetched_ratio, "pool_bytes": step.pool_bytes,
                               "device_bytes": step.device_bytes,
                               **count_decode_step(engine, ids[context + per_round + 1])}
    engine.reset()
    weights.restore()
    engine.kernels = kernels
    rows = []
    for name in configs:
        rows.append({"policy": name, "context": context, "ms_per_token": statistics.median(times[name]),
                     "prompt_tokens_per_s": context / prefill_s if name == first.policy and prefill_s else None,
                     "mean_ms": statistics.fmean(times[name]), "decode_steps": len(times[name]),
                     "prefill_s": prefill_s if name == first.policy else None, **facts[name],
                     "peak_rss_bytes": peak_rss_bytes(),  # the process's, so far: contexts in rising order
                     **{f"{part}_ms": statistics.median(s[part] for s in splits[name])
                        for part in ("speculate", "fetch_wait", "attention")}})
    if reference:
        # DynamicCache(offloading=True) moves the cache between a GPU and the host; on the CPU there is no row
        for offloading in (False, True) if engine.device.type == "cuda" else (False,):
            if progress:
                progress(f"context {context}: plain transformers reference{' (offloading)' if offloading else ''}")
            rows.append(transformers_reference(engine.model, ids, context, rounds * per_round, offloading=offloading))
    return with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """ratio_to_full and ratio_to_llama_cpp (where those rows exist) of each row's ms/token, per context."""
    for context in {row["context"] for row in rows}:
        same = [row for row in rows if row["context"] == context]
        for key, policy in (("ratio_to_full", "full"), ("ratio_to_llama_cpp", LLAMA_CPP)):
            base = next((row["ms_per_token"] for row in same if row["policy"] == policy), None)
            for row in same:
                row[key] = row["ms_per_token"] / base if base else None
    return rows


def llama_cpp_rows(python: str | Path, gguf: str | Path, ids: Sequence[int], contexts: Sequence[int],
                   decode_tokens_n: int, rounds: int, threads: int = 2, timeout_s: float = 2700,
                   flash_attn: Sequence[str] | None = None) -> list[dict]:
    """llama.cpp's rows (bench/llama_peer.py run by `python`, an interpreter with llama-cpp-python): per
    context the faster of flash attention on and off, as the row says, or the one setting `flash_attn`
    names for that context ("on", "off" or "both", one per context; an 8k prefill is ~1-2 minutes a round
    and setting here, a 32k one with it off most of an hour, hence the timeout and the choice)."""
    if not Path(gguf).is_file():
        raise EvalError(f"--gguf {gguf}: no such file")
    per_round = decode_tokens_n // rounds
    settings = flash_attn_per_context(flash_attn, len(contexts))
    request = {"decode_tokens": decode_tokens_n, "rounds": rounds,
               "contexts": [{"context": c, "ids": [int(t) for t in ids[: c + per_round + 1]], "flash_attn": fa}
                            for c, fa in zip(contexts, settings)]}
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        result = subprocess.run([str(python), str(PEER_SCRIPT), "--gguf", str(gguf), "--threads", str(threads)],
                                input=json.dumps(request), capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EvalError(f"llama.cpp peer did not run: {error}") from None
    if result.returncode != 0:
        raise EvalError(f"llama.cpp peer failed ({result.returncode}): {result.stderr.strip()[-600:]}")
    peer = json.loads(result.stdout.strip().splitlines()[-1])
    return [{"policy": LLAMA_CPP, **row, "fetched_ratio": 1.0, "llama_cpp_version": peer["llama_cpp"],
             "threads": peer["threads"]} for row in peer["rows"]]


FLASH_ATTN_CHOICES = {"both": ["on", "off"], "on": ["on"], "off": ["off"]}


def flash_attn_per_context(names: Sequence[str] | None, n_contexts: int) -> list[list[str]]:
    """The peer's flash attention settings per context: None -> both everywhere, one name -> that for every
    context, else one name per context."""
    names = list(names or ["both"])
    if len(names) == 1:
        names *= n_contexts
    if len(names) != n_contexts or any(name not in FLASH_ATTN_CHOICES for name in names):
        raise EvalError(f"--llama-flash-attn: one of {', '.join(FLASH_ATTN_CHOICES)} for every context, or one per "
                        f"context ({n_contexts}), got {','.join(names)}")
    return [FLASH_ATTN_CHOICES[name] for name in names]


def count_decode_step(engine, token: int) -> dict:
    """Aten ops, host reads of device values and copies to the host in one decode step of the engine."""
    copies = engine.fetcher.host.copies
    with OpCounter() as ops:
        engine.decode(int(token))
    engine.truncate(engine.num_tokens - 1)
    return {"ops_per_step": ops.total, "syncs_per_step": ops.syncs, "host_copies_per_step": engine.fetcher.host.copies - copies}


@torch.inference_mode()
def transformers_reference(model, ids: Sequence[int], context: int, steps: int, chunk: int = 512,
                           offloading: bool = False) -> dict:
    """Prefill and decode with the model's own attention and DynamicCache (offloaded to the host if asked):
    what the engine is measured against."""
    from transformers import DynamicCache

    from infinigen_core.weights import plain_fp32_weights

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    weights = plain_fp32_weights(model)  # the reference is plain transformers: its fp32 Linear layers
    weights.__enter__()
    try:
        cache = DynamicCache(config=model.config, offloading=offloading)
        no_rows = torch.empty(0, dtype=torch.long, device=model.device)  # as the engine: no head before the last chunk
        started = time.perf_counter()
        for start in range(0, context, chunk):
            piece = torch.tensor([list(ids[start : min(start + chunk, context)])], device=model.device)
            model(input_ids=piece, past_key_values=cache, use_cache=True,
                  logits_to_keep=1 if start + chunk >= context else no_rows)
        synchronize(model.device)
        prefill_s = time.perf_counter() - started
        step_ms = []
        for token in ids[context : context + steps + 1]:
            started = time.perf_counter()
            model(input_ids=torch.tensor([[int(token)]], device=model.device), past_key_values=cache, use_cache=True)
            synchronize(model.device)
            step_ms.append((time.perf_counter() - started) * 1e3)
        with OpCounter() as ops:
            model(input_ids=torch.tensor([[int(ids[context + steps + 1])]], device=model.device),
                  past_key_values=cache, use_cache=True)
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        cache_bytes = sum(t.numel() * t.element_size() for t in tensors)
        # offloaded, most layers sit on the host between steps: count what is on the device
        device_bytes = sum(t.numel() * t.element_size() for t in tensors if t.device == model.device)
        del cache
    finally:
        model.set_attn_implementation(previous)
        weights.__exit__(None, None, None)
    timed = step_ms[1:]
    return {"policy": HF_OFFLOAD if offloading else REFERENCE, "context": context,
            "ms_per_token": statistics.median(timed), "mean_ms": statistics.fmean(timed), "decode_steps": len(timed),
            "prefill_s": prefill_s, "fetched_ratio": 1.0, "pool_bytes": cache_bytes, "device_bytes": device_bytes,
            "ops_per_step": ops.total, "syncs_per_step": ops.syncs, "host_copies_per_step": None}
