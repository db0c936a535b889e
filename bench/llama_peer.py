"""llama.cpp as a speed peer: run by another interpreter (one with llama-cpp-python), never imported by us.

    /path/to/venv/bin/python bench/llama_peer.py --gguf model.gguf --threads 2 < request.json

The request (stdin, JSON): {"contexts": [{"context": N, "ids": [prefix ids..., next ids...]}], "decode_tokens": 24,
"rounds": 3}. Per context, once with flash attention on and once off (llama.cpp's tools default to
`-fa auto`, on where the backend has it, as the CPU backend does; on this CPU it speeds up prefill and short
contexts but slows decode at 8k, so a demanding user picks per case, and so do we; a context's optional
"flash_attn": ["on"] runs that setting alone, as a 32k prefill with it off takes most of an hour at one thread):
the prefix is evaluated once from an empty cache (timed: prompt tokens/s), as our rows prefill once per context;
then per round `decode_tokens // rounds` decode steps each evaluate one token of the text (the same tokens our
rows decode) and take the greedy argmax of its logits (timed: ms/token; the first step after the prefix is a
warm-up), and the cache drops what the round decoded, back to the prefix, as llama-cpp-python reuses a prompt's
prefix (where the cache cannot drop a part, the prefix is evaluated again, untimed). The settings alternate round
by round. A row gives the faster setting's figures, each named: `ms_per_token` and
`flash_attn` (the decode's), `prompt_tokens_per_s` and `prefill_flash_attn`, and both settings' medians.
Prints one JSON object: {"llama_cpp": version, "threads": T, "rows": [{"context", "ms_per_token", "mean_ms",
"decode_steps", "prompt_tokens_per_s", "prefill_s", "flash_attn", "prefill_flash_attn", "ms_per_token_by_fa",
"prefill_s_by_fa", "peak_rss_bytes"}]}, `peak_rss_bytes` being this process's peak resident memory over the run
(the model, and the KV cache of each setting run). Standard library + llama_cpp + numpy only.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time


FA_NAMES = {True: "on", False: "off"}


def flash_attn_settings(names: list[str]) -> tuple[bool, ...]:
    """The flash attention settings to run, in order: ["on", "off"] -> (True, False)."""
    if not names or any(name not in ("on", "off") for name in names):
        raise SystemExit(f"flash_attn must list \"on\" and/or \"off\", got {names!r}")
    return tuple(dict.fromkeys(name == "on" for name in names))


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: the high-water mark of its own memory map (Linux's VmHWM), for
    our rows (bench/speed.py) and the peer's alike. Not getrusage's ru_maxrss, which Linux carries over fork and
    exec from the process that started this one: run by `bench speed`, llama.cpp's figure was ours (4.15 GB for
    Gemma 3 at 32k)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def back_to_prefix(llm, ids: list[int], context: int) -> None:
    """The cache as it was after the prefix: what a round decoded is dropped (llama-cpp-python's own prompt-prefix
    reuse, the cells from position `context` on); a cache that cannot drop a part evaluates the prefix again."""
    if llm.n_tokens == context:
        return
    if llm._ctx.kv_cache_seq_rm(-1, context, -1):
        llm.n_tokens = context
    else:
        llm.reset()
        llm.eval(ids[:context])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    request = json.load(sys.stdin)

    import llama_cpp
    import numpy as np

    contexts = request["contexts"]
    per_round = max(1, request["decode_tokens"] // request["rounds"])
    n_ctx = max(len(c["ids"]) for c in contexts) + per_round + 16
    per_context = [flash_attn_settings(entry.get("flash_attn", ["on", "off"])) for entry in contexts]
    models = {fa: llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                                  n_ctx=n_ctx, n_batch=512, flash_attn=fa, logits_all=False, verbose=False)
              for fa in dict.fromkeys(fa for settings in per_context for fa in settings)}
    vocab = next(iter(models.values())).n_vocab()
    rows = []
    for entry, settings in zip(contexts, per_context):
        context, ids = entry["context"], [int(t) for t in entry["ids"]]
        step_ms: dict[bool, list[float]] = {fa: [] for fa in settings}
        prefill_s: dict[bool, float] = {}
        for fa in settings:
            llm = models[fa]
            llm.reset()
            started = time.perf_counter()
            llm.eval(ids[:context])
            prefill_s[fa] = time.perf_counter() - started
        for _ in range(request["rounds"]):
            for fa in settings:  # the settings interleaved, round by round
                llm = models[fa]
                back_to_prefix(llm, ids, context)
                timings = []
                for token in ids[context : context + per_round + 1]:
                    started = time.perf_counter()
                    llm.eval([token])
                    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
                    int(logits.argmax())  # greedy, as our steps' argmax
                    timings.append((time.perf_counter() - started) * 1e3)
                step_ms[fa] += timings[1:]
        median_ms = {fa: statistics.median(step_ms[fa]) for fa in settings}
        decode_fa = min(settings, key=median_ms.__getitem__)
        prefill_fa = min(settings, key=prefill_s.__getitem__)
        rows.append({"context": context, "ms_per_token": median_ms[decode_fa],
                     "mean_ms": statistics.fmean(step_ms[decode_fa]), "decode_steps": len(step_ms[decode_fa]),
                     "prefill_s": prefill_s[prefill_fa], "prompt_tokens_per_s": context / prefill_s[prefill_fa],
                     "flash_attn": decode_fa, "prefill_flash_attn": prefill_fa,
                     "ms_per_token_by_fa": {FA_NAMES[fa]: median_ms[fa] for fa in settings},
                     "prefill_s_by_fa": {FA_NAMES[fa]: prefill_s[fa] for fa in settings}})
    peak = peak_rss_bytes()
    for row in rows:
        row["peak_rss_bytes"] = peak
    print(json.dumps({"llama_cpp": llama_cpp.__version__, "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
