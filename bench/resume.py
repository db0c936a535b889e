"""Resume versus re-prefill: how much sooner the first new token comes when the KV pool is read from disk,
what the chunks cost on disk, and what a compact format does to the conversation that follows.

    python -m bench resume --context 8192 --text book.txt --formats int8,exact --json

One long conversation is built once (a document as the first message, a short reply). Its KV rows are
then saved in every format asked for, as a session of their own. Per format:

- cold: each chunk file is dropped from the page cache (fsync, then POSIX_FADV_DONTNEED) and the session
  reopened, as it is days later; warm: reopened again at once. `resume_s` runs from opening the session to
  the first token of a follow-up question.
- `resumed_ppl_delta`: after the cold reopen, the text that follows the document is scored one decode step
  at a time, and its perplexity compared with the same text scored on the uninterrupted conversation
  (+0.001 = 0.1% worse).

`reprefill_s` is what an app without a saved KV cache does: run the model over the whole conversation and
the question again, up to the first token.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

from infinigen_core import SamplingConfig
from infinigen_core.prefix import common_prefix_length
from sessions.chat import REPLY_RESERVE_TOKENS, ChatSession
from sessions.snapshots import BENCHMARK_FORMATS, KV_FORMATS, ChunkRecord, write_chunk
from sessions.storage import StorageConfig
from sessions.store import SessionStore

from .common import EvalError, mean_nll, repeated_token_ids

QUESTION = "What is the first word?"
RESUME_COLUMNS = ["format", "cold", "tokens", "disk_bytes_per_token", "open_s", "resume_s", "reprefill_s", "speedup",
                  "resumed_ppl_delta"]


def first_token_seconds(chat: ChatSession, question: str) -> float:
    started = time.perf_counter()
    events = chat.send(question, SamplingConfig(max_new_tokens=1))
    next(events)
    elapsed = time.perf_counter() - started
    for _ in events:  # finish the turn so it is stored
        pass
    return elapsed


def forget_question(store: SessionStore, session_id: str, tokens: int) -> None:
    """Drop the question's turn (its messages and KV after `tokens`), so the next reopen finds the conversation
    as it was built."""
    store.drop_chunks_from(session_id, tokens)
    store.delete_messages_from(session_id, 2)
    store.update(session_id, token_count=tokens)


def _mean_nll(engine, tokens: list[int]) -> float:
    """Mean negative log-likelihood of tokens[1:], each predicted by one decode step (the chat path)."""
    total, count = mean_nll(engine.score(tokens[:-1]), tokens[1:])
    return total / count


def evict_from_page_cache(path: Path) -> None:
    """Make the next read of `path` come from the disk: sync its pages, then drop them (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _copy_session(source: SessionStore, source_id: str, target: SessionStore, rows: dict, signature: dict,
                  tokens: int, kv_format: str, partial_keys: dict[int, str]) -> tuple[str, ChunkRecord]:
    """The built conversation as a session of `target`, its KV written in `kv_format` as one chunk (with the
    partial keys where the format holds them)."""
    session_id = target.create("resume benchmark")
    for m in source.messages(source_id):
        target.add_message(session_id, m.role, m.content, m.token_start, m.token_end)
    record = write_chunk(target.data_dir, session_id, rows, signature, 0, kv_format, partial_keys)
    target.add_chunk(session_id, record, signature, tokens)
    return session_id, record


def measure_resume(engine, context_tokens: int, data_dir: Path | str | None = None, formats=tuple(KV_FORMATS),
                   text: str | None = None, ppl_tokens: int = 128, progress=None) -> dict:
    """Rows of {format, cold, tokens, disk_bytes_per_token, open_s, resume_s, reprefill_s, speedup,
    resumed_ppl_delta}: a cold and a warm row per format (see the module docstring)."""
    say = progress or (lambda message: None)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(data_dir or scratch)
        build = SessionStore(root / "build", StorageConfig(kv_format="exact"))
        built_id = build.create("resume benchmark")
        # leave room in the window for the scored text, the follow-up question and its reply
        target = min(context_tokens, engine.max_context - 2 * REPLY_RESERVE_TOKENS - ppl_tokens)
        document_tokens = target - 120
        ids = repeated_token_ids(engine.tokenizer, text, document_tokens + ppl_tokens + 1)
        document, following = ids[:document_tokens], ids[document_tokens : document_tokens + ppl_tokens + 1]
        say(f"building a {target}-token conversation")
        with ChatSession.open(build, engine, built_id) as chat:
            message = "Here is a document:\n\n" + engine.tokenizer.decode(document)
            for _ in chat.send(message, SamplingConfig(max_new_tokens=8)):
                pass
            full_prompt = chat._conversation_ids(extra_user=QUESTION, generation_prompt=True)
            # the conversation as the next turn reads it: a reply's last tokens may be written differently once
            # it is a past turn (a plain transcript strips it), and the session's chunk must end where both agree
            tokens = common_prefix_length(engine.token_ids, full_prompt)
            engine.truncate(tokens)
            rows, signature = engine.export_rows(0, tokens, partial_keys=True), engine.kv_signature()
            partial_keys = engine.partial_key_digests()
            say(f"scoring {ppl_tokens} tokens of the following text on the uninterrupted conversation")
            uninterrupted_nll = _mean_nll(engine, following)
            engine.truncate(tokens)

        say("re-prefill: running the model over the whole conversation again")
        engine.reset()
        started = time.perf_counter()
        int(engine.prefill(full_prompt).argmax())
        reprefill_s = time.perf_counter() - started

        results = []
        for kv_format in formats:
            # (a benchmark-only format is written for the conversation; the question's turn, dropped below,
            # is written as the app would)
            store = SessionStore(root / kv_format, StorageConfig(kv_format=kv_format if kv_format in KV_FORMATS
                                                                 else "int8"))
            session_id, chunk = _copy_session(build, built_id, store, rows, signature, tokens, kv_format,
                                              partial_keys)
            delta = None  # scored after the cold reopen; the warm one reads the same chunk
            for cold in (True, False):
                if cold:
                    evict_from_page_cache(store.data_dir / chunk.file)
                say(f"{kv_format}: reopening {'cold' if cold else 'warm'}")
                engine.reset()  # drop every in-memory trace of the conversation
                started = time.perf_counter()
                with ChatSession.open(store, engine, session_id) as chat:
                    open_s = time.perf_counter() - started
                    if chat.restore.tokens_restored != tokens or chat.restore.rebuilt:
                        raise RuntimeError(f"the {kv_format} session did not restore: {chat.restore}")
                    resume_s = open_s + first_token_seconds(chat, QUESTION)
                    if cold:
                        say(f"{kv_format}: scoring the following text after the resume")
                        engine.truncate(tokens)
                        delta = math.exp(_mean_nll(engine, following) - uninterrupted_nll) - 1.0
                forget_question(store, session_id, tokens)
                results.append({
                    "format": kv_format, "cold": cold, "tokens": tokens, "disk_bytes_per_token": chunk.size / tokens,
                    "open_s": open_s, "resume_s": resume_s, "reprefill_s": reprefill_s,
                    "speedup": reprefill_s / resume_s, "resumed_ppl_delta": delta,
                })
        engine.reset()
    return {"rows": results, "scored_tokens": ppl_tokens, "text": "given" if text else "calibration text"}


def resume_versus_reprefill(engine, context: int, data_dir=None, formats=("int8", "exact"), text: str | None = None,
                            ppl_tokens: int = 128, progress=None) -> dict:
    """measure_resume's rows after checking the arguments; the first row (the first format, cold) also at the
    top level."""
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
