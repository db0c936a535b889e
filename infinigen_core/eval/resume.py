"""Time to the first new token after reopening a saved session, versus re-prefilling the conversation.

    python -m infinigen_core.eval resume --context 8192 --text book.txt --formats int8,exact

The measurement itself belongs to the sessions package (it owns saving and restoring); this wraps it.
"""

from __future__ import annotations

from .common import EvalError

RESUME_COLUMNS = ["format", "cold", "tokens", "disk_bytes_per_token", "open_s", "resume_s", "reprefill_s", "speedup",
                  "resumed_ppl_delta"]


def resume_versus_reprefill(engine, context: int, data_dir=None, formats=("int8", "exact"), text: str | None = None,
                            ppl_tokens: int = 128, progress=None) -> dict:
    """sessions.benchmark.measure_resume's rows; the first (the first format, cold) also at the top level."""
    try:
        from sessions.benchmark import measure_resume
        from sessions.snapshots import BENCHMARK_FORMATS
    except ImportError as error:
        raise EvalError(f"the resume benchmark needs the sessions package (sessions.benchmark): {error}") from None
    if context < 64:
        raise EvalError(f"--context must be at least 64 tokens, got {context}")
    unknown = [f for f in formats if f not in BENCHMARK_FORMATS]
    if not formats or unknown:
        raise EvalError(f"unknown KV format {', '.join(unknown) or '(none given)'}: choose from "
                        f"{', '.join(BENCHMARK_FORMATS)}")
    if ppl_tokens < 2:
        raise EvalError(f"--ppl-tokens must be at least 2, got {ppl_tokens}")
    result = measure_resume(engine, context, data_dir, tuple(formats), text, ppl_tokens, progress)
    return {**result["rows"][0], **result}
