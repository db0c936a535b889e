"""The prompt's KV chunk is written on a background thread: the first token does not wait for it, and a
close, a reload and the turn's own end wait for it (real default model; the chunk writer is held with an
event to make the in-between state observable)."""

import threading

import pytest

import sessions.chunk_writer
from infinigen_core.config import SamplingConfig
from sessions import ChatSession, SessionStore

QUESTION = "Name three rivers of Europe and say where each one meets the sea."


@pytest.fixture
def held_writes(monkeypatch):
    """`write_chunk` that waits until `release` is set (then writes for real); `calls` counts its calls."""
    real_write = sessions.chunk_writer.write_chunk
    state = {"release": threading.Event(), "calls": 0, "fail_first": False}

    def held_write(*args, **kwargs):
        state["calls"] += 1
        state["release"].wait(timeout=60)
        if state["fail_first"] and state["calls"] == 1:
            raise OSError("disk full (simulated)")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(sessions.chunk_writer, "write_chunk", held_write)
    yield state
    state["release"].set()


def test_the_first_token_comes_before_the_prompts_chunk_is_written(tmp_path, real_engine, held_writes):
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Background write")
    with ChatSession.open(store, real_engine, session_id) as chat:
        prompt_tokens = len(chat.prompt_ids(QUESTION))
        events = chat.send(QUESTION, SamplingConfig(max_new_tokens=3))
        try:
            first = next(events)
            # the reply is stored and shown while its prompt's rows are still on their way to the disk
            assert first.token_id is not None
            assert [m.role for m in chat.messages] == ["user", "assistant"]
            assert store.chunks(session_id) == [] and held_writes["calls"] == 1
        finally:
            held_writes["release"].set()
        rest = list(events)
        assert rest[-1].finish_reason is not None
        # the turn's end waited for the prompt's chunk, then wrote the reply's after it
        spans = [(c.start, c.end) for c in store.chunks(session_id)]
        assert spans == [(0, prompt_tokens), (prompt_tokens, real_engine.num_tokens)]


def test_close_waits_for_the_pending_chunk(tmp_path, real_engine, held_writes):
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Close while writing")
    chat = ChatSession.open(store, real_engine, session_id)
    prompt_tokens = len(chat.prompt_ids(QUESTION))
    events = chat.send(QUESTION, SamplingConfig(max_new_tokens=3))
    next(events)  # the turn is left suspended at its first token, its prompt's chunk held
    closing = threading.Thread(target=chat.close)
    closing.start()
    closing.join(timeout=0.5)
    assert closing.is_alive(), "close returned while the prompt's chunk was still being written"
    held_writes["release"].set()
    closing.join(timeout=60)
    assert not closing.is_alive()
    assert [(c.start, c.end) for c in store.chunks(session_id)] == [(0, prompt_tokens)]
    events.close()
    with ChatSession.open(store, real_engine, session_id) as reopened:  # the lock was released after the write
        assert reopened.restore.tokens_restored >= prompt_tokens and not reopened.restore.rebuilt


def test_a_failed_background_write_is_written_again_at_the_turns_end(tmp_path, real_engine, held_writes):
    held_writes["fail_first"] = True
    held_writes["release"].set()
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Failed write")
    with ChatSession.open(store, real_engine, session_id) as chat:
        prompt_tokens = len(chat.prompt_ids(QUESTION))
        list(chat.send(QUESTION, SamplingConfig(max_new_tokens=3)))
        spans = [(c.start, c.end) for c in store.chunks(session_id)]
        assert spans == [(0, prompt_tokens), (prompt_tokens, real_engine.num_tokens)]
        tokens = list(real_engine.token_ids)
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as reopened:
        assert not reopened.restore.rebuilt and reopened.restore.tokens_prefilled == 0
        assert real_engine.token_ids == tokens
