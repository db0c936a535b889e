"""How much compact decode weights (infinigen_core/weights.py) change what the model says, against fp32.

    python -m bench weights --text book.txt --context 1024 --windows 2 --kinds int8,int4,auto

Per window of the text: the first `prefill` tokens are prefilled (always with the fp32 weights), the rest
are fed one decode step at a time with each kind of decode weights in turn, under one policy (default
full). Per kind: perplexity of the scored tokens and its change against fp32 (`ppl_vs_fp32`); `agreement`,
the share of steps whose top token is fp32's top token (teacher-forced on the text, so one slip does not
spoil the rest); `max_logit_diff`; and `match_prefix`, the greedy tokens generated from the window's
prefix that equal fp32's before the first difference (what a chat user would see), out of `--new-tokens`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from infinigen_core import EngineConfig
from infinigen_core.weights import compact_layers, restore_fp32_weights, use_decode_weights
from .agree import greedy_continuation, matching_prefix
from .common import EvalError, decode_tokens, load_prefix, mean_nll
from .ppl import check_scoring_windows

REFERENCE_KIND = "fp32"


class DecodeWeights:
    """Switches the engine's model between decode-weight kinds (weights.py), each built once, and back to
    how it was loaded after."""

    def __init__(self, model, kernels=None) -> None:
        self.model, self.kernels = model, kernels  # kernels: the CPU kernels, for the q8_0 head (weights.py)
        self.current = "loaded"
        self.layers = {"loaded": compact_layers(model)}

    def use(self, kind: str | None) -> None:
        """`kind` (fp32 | int8 | int4 | auto) for every layer, or None: as loaded."""
        kind = kind or "loaded"
        if kind == self.current:
            return
        restore_fp32_weights(self.model)
        if kind not in self.layers:
            if kind != "fp32" and not use_decode_weights(self.model, kind, self.kernels):
                raise EvalError(f"{kind} decode weights are unavailable here (see the log)")
            self.layers[kind] = compact_layers(self.model)
        for parent, name, child in self.layers[kind]:
            setattr(parent, name, child)
        self.current = kind

    def restore(self) -> None:
        self.use(None)


def compare_weights(engine, windows: Sequence[Sequence[int]], prefill: int, kinds: Sequence[str], config: EngineConfig,
                    new_tokens: int = 32, progress=None) -> dict[str, dict]:
    """Per kind (fp32 first, the reference): ppl, ppl_vs_fp32, agreement, max_logit_diff, match_prefix, ms_per_token."""
    check_scoring_windows(windows, prefill)
    kinds = [REFERENCE_KIND, *(kind for kind in kinds if kind != REFERENCE_KIND)]
    weights = DecodeWeights(engine.model, engine.kernels)
    per = {kind: {"nll": 0.0, "count": 0, "agree": [], "diff": 0.0, "prefix": [], "ms": []} for kind in kinds}
    try:
        for index, window in enumerate(windows):
            prefix, rest = list(window[:prefill]), list(window[prefill:])
            reference_logits = reference_greedy = None
            for kind in kinds:
                if progress:
                    progress(f"window {index + 1}/{len(windows)}: {kind} ({len(rest) - 1} decode steps)")
                weights.use(kind)
                load_prefix(engine, config, prefix)
                run = decode_tokens(engine, rest[:-1])
                greedy = greedy_continuation(engine, config, prefix, new_tokens)
                if reference_logits is None:
                    reference_logits, reference_greedy = run.logits, greedy
                totals = per[kind]
                nll, count = mean_nll(run.logits, rest[1:])
                totals["nll"] += nll
                totals["count"] += count
                totals["agree"] += (run.logits.argmax(-1) == reference_logits.argmax(-1)).tolist()
                totals["diff"] = max(totals["diff"], float((run.logits - reference_logits).abs().max()))
                totals["prefix"].append(matching_prefix(greedy, reference_greedy))
                totals["ms"] += run.step_ms
    finally:
        engine.reset()
        weights.restore()
    reference_ppl = math.exp(per[REFERENCE_KIND]["nll"] / per[REFERENCE_KIND]["count"])
    results = {}
    for kind, totals in per.items():
        ppl = math.exp(totals["nll"] / totals["count"])
        results[kind] = {"ppl": ppl, "ppl_vs_fp32": ppl / reference_ppl - 1.0,
                         "agreement": statistics.fmean(totals["agree"]), "max_logit_diff": totals["diff"],
                         "match_prefix": statistics.fmean(totals["prefix"]), "new_tokens": new_tokens,
                         # the median: a kind's first step after a switch recompiles the compiled step (a minute
                         # or more), which the mean spread over every step (SmolLM2's int8 read 401 ms a token)
                         "ms_per_token": statistics.median(totals["ms"]), "scored_tokens": totals["count"]}
    return results
