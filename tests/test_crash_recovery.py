"""A crash loses only the reply in flight: kill -9 mid-reply, reopen, and neither the prompt nor the reply so
far is read again (its KV rows were written while it streamed).

A real child process (tests/crash_worker.py) runs the default model; the test reopens its session here. The
prompt is a few hundred tokens, not the issue's 4k: the chunks, their order and what the next turn reads do
not depend on the prompt's length (docs/HOSTILE.md times the 4k case).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sessions.chat
from infinigen_core.config import SamplingConfig
from sessions import ChatSession, SessionStore
from sessions.chunk_writer import STREAM_MIN_TOKENS, SessionChunks
from sessions.snapshots import read_chunk

from conftest import make_tiny_engine, random_tokens

ROOT = Path(__file__).resolve().parents[1]
STREAMED = 150  # reply tokens the worker streams before the kill (tests/crash_worker.py's REPLY_TOKENS)


def kill_worker_mid_reply(data_dir: Path, session_id: str, notes_repeats: int = 12) -> tuple[int, str]:
    """Run the worker until its reply's KV rows have been written while streaming, SIGKILL it; returns (prompt
    tokens, the reply text stored at the kill). `notes_repeats`: the prompt's length (crash_worker.py)."""
    worker = subprocess.Popen([sys.executable, str(ROOT / "tests" / "crash_worker.py"), str(data_dir), session_id,
                               str(notes_repeats)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    prompt_tokens, partial = None, None
    try:
        for line in worker.stdout:
            if line.startswith("PROMPT"):
                prompt_tokens = int(line.split()[-1])
            if line.startswith("PARTIAL"):
                partial = json.loads(line.split(" ", 1)[1])
                break
        else:
            pytest.fail("the worker's reply ended before its KV was stored mid-stream")
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    assert prompt_tokens and partial
    return prompt_tokens, partial


def test_kill_9_mid_reply_keeps_the_kv_of_the_prompt_and_of_the_reply_so_far(tmp_path, real_engine):
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Crash mid-reply")
    prompt_tokens, partial = kill_worker_mid_reply(store.data_dir, session_id)
    assert prompt_tokens > 200  # a prompt worth keeping: re-reading it is what the fix avoids

    reopened = SessionStore(store.data_dir)
    with ChatSession.open(reopened, real_engine, session_id) as chat:  # the dead process's lock is gone
        messages = chat.messages
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == partial  # the reply as it was stored while streaming
        spans = [(c.start, c.end) for c in reopened.chunks(session_id)]
        assert spans[0] == (0, prompt_tokens) and spans[-1][1] > prompt_tokens + STREAMED
        assert spans[-1][1] <= messages[1].token_end  # no KV for reply text that was not stored
        # the prompt's and the reply's rows came back from their chunks; nothing was recomputed
        assert not chat.restore.rebuilt and chat.restore.tokens_restored == spans[-1][1]
        assert chat.restore.tokens_prefilled == 0

        next_prompt = chat.prompt_ids("Thanks.")
        assert len(next_prompt) - prompt_tokens > 100  # what the next turn would read without the reply's KV
        events = list(chat.send("Thanks.", SamplingConfig(max_new_tokens=4)))
        assert events[-1].finish_reason is not None
        # the next turn reads the new message and what of the reply came after its last chunk, no more
        assert chat.last_read_tokens < 100
        assert [m.role for m in chat.messages] == ["user", "assistant", "user", "assistant"]
        assert chat.messages[1].content == partial


def test_a_streamed_replys_chunks_trail_its_text_and_are_swapped_for_one_at_its_end(tmp_path, real_engine,
                                                                                   monkeypatch):
    monkeypatch.setattr(sessions.chat, "REPLY_SAVE_TOKENS", 16)  # a save every 16 tokens, however fast
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Streamed chunks")
    question = "Tell me a long story about a lighthouse keeper and his cat."
    with ChatSession.open(store, real_engine, session_id) as chat:
        prompt_tokens = len(chat.prompt_ids(question))
        spans_seen = set()
        for event in chat.send(question, SamplingConfig(max_new_tokens=64)):
            chunks, reply = store.chunks(session_id), store.messages(session_id)[-1]
            if reply.role == "assistant" and chunks:
                assert chunks[-1].end <= reply.token_end  # the text is stored first, its rows after
                spans_seen.update((c.start, c.end) for c in chunks)
        assert event.finish_reason == "length"  # 64 tokens: three saves' worth of stand-ins
        end = real_engine.num_tokens
        streamed = sorted(span for span in spans_seen if span[0] >= prompt_tokens)
        assert len(streamed) >= 2 and streamed[0][0] == prompt_tokens
        # the turn's end wrote the reply whole, in place of the stand-ins, whose files are gone
        chunks = store.chunks(session_id)
        assert [(c.start, c.end) for c in chunks] == [(0, prompt_tokens), (prompt_tokens, end)]
        assert store.get(session_id).token_count == end
        assert sorted(p.name for p in (store.data_dir / "kv" / session_id).iterdir()) == \
            sorted(Path(c.file).name for c in chunks)
        tokens = list(real_engine.token_ids)
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as reopened:
        assert not reopened.restore.rebuilt and reopened.restore.tokens_prefilled == 0
        assert real_engine.token_ids == tokens


def prompt_read_in_a_session(tmp_path, tiny_llama, title: str):
    """A tiny engine that has read a 40-token prompt, a new session, and the session's chunk writer."""
    engine = make_tiny_engine(tiny_llama)
    store = SessionStore(tmp_path / "data")
    session_id = store.create(title)
    prompt = random_tokens(40, seed=3)
    engine.sync_to(prompt)
    return engine, store, session_id, SessionChunks(store, session_id), prompt


def test_stand_in_chunks_follow_the_stream_and_one_chunk_replaces_them(tmp_path, tiny_llama):
    """SessionChunks alone, on a tiny random model: what a streamed reply leaves on disk, and what its end does."""
    engine, store, session_id, chunks, prompt = prompt_read_in_a_session(tmp_path, tiny_llama, "Stand-ins")
    chunks.persist(engine, boundary=len(prompt), background=True)  # the prompt's chunk, at the first token
    assert not chunks.stream(engine)  # nothing new yet
    for round_, token in enumerate(random_tokens(3 * STREAM_MIN_TOKENS, seed=4)):
        engine.decode(token)
        if round_ % STREAM_MIN_TOKENS == STREAM_MIN_TOKENS - 1:
            assert chunks.stream(engine)
            chunks.wait()  # as the next save would find it
    spans = [(c.start, c.end) for c in store.chunks(session_id)]
    step = STREAM_MIN_TOKENS
    assert spans == [(0, 40), (40, 40 + step), (40 + step, 40 + 2 * step), (40 + 2 * step, 40 + 3 * step)]
    assert store.get(session_id).token_count == 40 + 3 * step
    for token in random_tokens(5, seed=5):  # the reply goes on a little after its last save, then ends
        engine.decode(token)
    chunks.persist(engine, boundary=len(prompt))
    end = engine.num_tokens
    records = store.chunks(session_id)
    assert [(c.start, c.end) for c in records] == [(0, 40), (40, end)]
    assert store.get(session_id).token_count == end
    assert sorted(p.name for p in (store.data_dir / "kv" / session_id).iterdir()) == \
        sorted(Path(c.file).name for c in records)  # the stand-ins' files are gone
    reply = read_chunk(store.data_dir, records[1], engine.kv_signature())
    assert reply["token_ids"].tolist() == engine.token_ids[40:end]
    engine.close()


def test_the_swap_of_stand_ins_and_the_token_count_commit_together(tmp_path, tiny_llama, monkeypatch):
    """A failure while the turn's end swaps its stand-ins (a crash mid-commit) leaves the stand-ins and their
    count, never the new chunk with the count of the stand-ins: the two are one transaction."""
    import sqlite_utils.db

    engine, store, session_id, chunks, prompt = prompt_read_in_a_session(tmp_path, tiny_llama, "One transaction")
    chunks.persist(engine, boundary=len(prompt))
    for token in random_tokens(STREAM_MIN_TOKENS, seed=4):
        engine.decode(token)
    assert chunks.stream(engine)
    chunks.wait()
    for token in random_tokens(5, seed=5):
        engine.decode(token)
    before = [(c.start, c.end) for c in store.chunks(session_id)]
    original_update = sqlite_utils.db.Table.update

    def failing_update(table, *args, **kwargs):
        if table.name == "sessions":
            raise OSError("the disk went away mid-commit")
        return original_update(table, *args, **kwargs)

    monkeypatch.setattr(sqlite_utils.db.Table, "update", failing_update)
    with pytest.raises(OSError, match="mid-commit"):
        chunks.persist(engine, boundary=len(prompt))
    monkeypatch.undo()
    assert [(c.start, c.end) for c in store.chunks(session_id)] == before == [(0, 40), (40, 40 + STREAM_MIN_TOKENS)]
    assert store.get(session_id).token_count == 40 + STREAM_MIN_TOKENS
    chunks.persist(engine, boundary=len(prompt))  # the next save swaps them
    assert [(c.start, c.end) for c in store.chunks(session_id)] == [(0, 40), (40, engine.num_tokens)]
    assert store.get(session_id).token_count == engine.num_tokens
    engine.close()


def test_a_save_that_fails_in_the_background_leaves_the_stand_ins_for_the_next_save(tmp_path, tiny_llama,
                                                                                  monkeypatch):
    """The disk is full at a turn's end and still at the next turn's first token (whose save runs in the
    background): the stand-ins of the first reply stay on disk and marked, and the first save that succeeds
    swaps them, so the session ends as if nothing had failed and reads back whole."""
    engine, store, session_id, chunks, prompt = prompt_read_in_a_session(tmp_path, tiny_llama, "Disk full")
    chunks.persist(engine, boundary=len(prompt))
    for token in random_tokens(STREAM_MIN_TOKENS + 5, seed=4):  # a reply, its first 16 rows as a stand-in
        engine.decode(token)
        if engine.num_tokens == len(prompt) + STREAM_MIN_TOKENS:
            assert chunks.stream(engine)
            chunks.wait()
    stand_in = store.chunks(session_id)[-1]
    assert (stand_in.start, stand_in.end) == (40, 40 + STREAM_MIN_TOKENS)
    real_fsync = os.fsync

    def disk_full(fd):  # the real writer runs up to its fsync, which finds no room
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        chunks.persist(engine, boundary=len(prompt))  # the turn's end
    engine.sync_to(engine.token_ids + random_tokens(12, seed=6))  # the next turn's prompt is read
    second_prompt = engine.num_tokens
    chunks.persist(engine, boundary=second_prompt, background=True)  # its first token: the save goes on aside
    chunks.wait()  # the failure is logged, not raised (the turn has gone on)
    assert store.chunks(session_id)[-1] == stand_in  # the stand-in is still the last thing on disk
    assert sorted(p.name for p in (store.data_dir / "kv" / session_id).iterdir()) == \
        sorted(Path(c.file).name for c in store.chunks(session_id))  # the failed writes left no partial file
    monkeypatch.setattr(os, "fsync", real_fsync)  # room again

    for token in random_tokens(3, seed=7):
        engine.decode(token)
    chunks.persist(engine, boundary=second_prompt)  # the second turn's end
    records = store.chunks(session_id)
    # the stand-in was swapped: from its start on, one chunk up to the second prompt's end and one for the reply
    assert [(c.start, c.end) for c in records] == [(0, 40), (40, second_prompt), (second_prompt, engine.num_tokens)]
    assert store.get(session_id).token_count == engine.num_tokens
    assert stand_in.file not in {c.file for c in records}
    assert not (store.data_dir / stand_in.file).exists()
    read_back = [read_chunk(store.data_dir, c, engine.kv_signature())["token_ids"].tolist() for c in records]
    assert sum(read_back, []) == engine.token_ids  # what a restart reads: every token once, in order
    engine.close()
