"""llama.cpp as a speed peer: run by another interpreter (one with llama-cpp-python), never imported by us.

    /path/to/venv/bin/python bench/llama_peer.py --gguf model.gguf --threads 2 < request.json

The request (stdin, JSON): {"contexts": [{"context": N, "ids": [prefix ids..., next ids...]}], "decode_tokens": 24,
"rounds": 3}. Per context and round: the prefix is evaluated from an empty cache (timed: prompt tokens/s), then
`decode_tokens // rounds` decode steps each evaluate one token of the text (the same tokens our rows decode)
and take the greedy argmax of its logits (timed: ms/token; the first step after the prefix is a warm-up).
Prints one JSON object: {"llama_cpp": version, "threads": T, "flash_attn": true, "rows": [{"context", "ms_per_token",
"mean_ms", "decode_steps", "prompt_tokens_per_s", "prefill_s"}]}. Standard library + llama_cpp + numpy only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


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
    # flash attention on, as llama.cpp's own tools run it by default where the backend has it (`-fa auto`; the
    # CPU backend does); the binding's default is still off
    llm = llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=n_ctx, n_batch=512, flash_attn=True, logits_all=False, verbose=False)
    vocab = llm.n_vocab()
    rows = []
    for entry in contexts:
        context, ids = entry["context"], [int(t) for t in entry["ids"]]
        step_ms, prefill = [], []
        for _ in range(request["rounds"]):
            llm.reset()
            started = time.perf_counter()
            llm.eval(ids[:context])
            prefill.append(time.perf_counter() - started)
            timings = []
            for token in ids[context : context + per_round + 1]:
                started = time.perf_counter()
                llm.eval([token])
                logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
                int(logits.argmax())  # greedy, as our steps' argmax
                timings.append((time.perf_counter() - started) * 1e3)
            step_ms += timings[1:]
        prefill_s = statistics.median(prefill)
        rows.append({"context": context, "ms_per_token": statistics.median(step_ms),
                     "mean_ms": statistics.fmean(step_ms), "decode_steps": len(step_ms),
                     "prefill_s": prefill_s, "prompt_tokens_per_s": context / prefill_s})
    print(json.dumps({"llama_cpp": llama_cpp.__version__, "threads": args.threads, "flash_attn": True, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
