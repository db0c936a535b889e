"""Resume versus re-prefill: how much sooner the first new token comes when the KV pool is read from disk.

    python -m infinigen_core.eval resume --context 8192
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from infinigen_core.calibration import calibration_text
from infinigen_core.config import SamplingConfig

from .chat import REPLY_RESERVE_TOKENS, ChatSession
from .store import SessionStore


def _long_document(tokenizer, tokens: int) -> str:
    text = calibration_text()
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += "\n\n" + calibration_text()
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def _first_token_seconds(chat: ChatSession, question: str) -> float:
    started = time.perf_counter()
    events = chat.send(question, SamplingConfig(max_new_tokens=1))
    next(events)
    elapsed = time.perf_counter() - started
    for _ in events:  # finish the turn so it is stored
        pass
    return elapsed


def measure_resume(engine, context_tokens: int, data_dir: Path | str | None = None) -> dict:
    """Build a ~context_tokens conversation, then time reopening it from disk against a re-prefill."""
    with tempfile.TemporaryDirectory() as scratch:
        store = SessionStore(data_dir or scratch)
        session_id = store.create("resume benchmark")
        # leave room in the window for the follow-up question and its reply, which send() checks for
        target = min(context_tokens, engine.max_context - 2 * REPLY_RESERVE_TOKENS)
        document = _long_document(engine.tokenizer, target - 120)
        with ChatSession.open(store, engine, session_id) as chat:
            for _ in chat.send("Here is a document:\n\n" + document, SamplingConfig(max_new_tokens=8)):
                pass
            tokens = engine.num_tokens
        engine.reset()  # drop every in-memory trace of the conversation

        question = "What is the first word?"
        started = time.perf_counter()
        with ChatSession.open(store, engine, session_id) as chat:
            open_s = time.perf_counter() - started
            full_prompt = chat._conversation_ids(extra_user=question, generation_prompt=True)
            resume_s = open_s + _first_token_seconds(chat, question)

        # what an app without a saved KV cache does: run the model over the whole conversation again
        engine.reset()
        started = time.perf_counter()
        int(engine.prefill(full_prompt).argmax())
        reprefill_s = time.perf_counter() - started
        engine.reset()
    return {"tokens": tokens, "resume_s": resume_s, "reprefill_s": reprefill_s, "speedup": reprefill_s / resume_s}
