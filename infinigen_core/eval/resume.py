"""Time to the first new token after reopening a saved session, versus re-prefilling the conversation.

    python -m infinigen_core.eval resume --context 8192

The measurement itself belongs to the sessions package (it owns saving and restoring); this wraps it.
"""

from __future__ import annotations

from .common import EvalError


def resume_versus_reprefill(engine, context: int, data_dir=None) -> dict:
    """{'tokens', 'resume_s', 'reprefill_s', 'speedup'} from sessions.benchmark.measure_resume."""
    try:
        from sessions.benchmark import measure_resume
    except ImportError as error:
        raise EvalError(f"the resume benchmark needs the sessions package (sessions.benchmark): {error}") from None
    if context < 64:
        raise EvalError(f"--context must be at least 64 tokens, got {context}")
    return measure_resume(engine, context, data_dir)
