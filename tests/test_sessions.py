"""Sessions: SQLite + safetensors persistence with the real default model."""

import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from infinigen_core.config import SamplingConfig
from infinigen_core.generation import chat_token_ids
from sessions import (
    ChatSession,
    ContextWindowError,
    ImportValidationError,
    SessionLockedError,
    SessionNotFoundError,
    SessionStore,
    StorageConfig,
)
from sessions.chat import conversation

SHORT = SamplingConfig(max_new_tokens=6)
ROOT = Path(__file__).resolve().parents[1]


def run_turn(chat, text, sampling=SHORT):
    events = list(chat.send(text, sampling))
    return events[-1].full_text


@pytest.fixture
def store(tmp_path):
    return SessionStore(tmp_path / "data")


@pytest.fixture
def two_turn_session(store, real_engine):
    session_id = store.create("Geography", system_prompt="You are a terse assistant.")
    with ChatSession.open(store, real_engine, session_id) as chat:
        run_turn(chat, "What is the capital of France?")
        run_turn(chat, "And of Italy?")
        tokens = list(real_engine.token_ids)
    real_engine.reset()
    return session_id, tokens


def test_store_lists_renames_and_deletes(store, two_turn_session):
    session_id, tokens = two_turn_session
    [summary] = store.list()
    assert summary.title == "Geography" and summary.message_count == 4 and summary.token_count == len(tokens)
    assert summary.bytes_on_disk == sum(c.size for c in store.chunks(session_id)) > 0
    store.rename(session_id, "Capitals")
    assert store.get(session_id).title == "Capitals"
    files = [store.data_dir / c.file for c in store.chunks(session_id)]
    # per turn a chunk for its prompt's new tokens and one for its reply, never the whole cache again
    assert all(f.exists() for f in files) and len(files) == 4
    store.delete(session_id)
    assert store.list() == [] and not any(f.exists() for f in files)
    with pytest.raises(SessionNotFoundError):
        store.get(session_id)


def test_reopened_session_continues_exactly_like_an_uninterrupted_run(tmp_path, real_engine):
    store = SessionStore(tmp_path / "data", StorageConfig(kv_format="exact"))
    session_id = store.create("Round trip")
    follow_up = "Name one famous museum there."
    with ChatSession.open(store, real_engine, session_id) as chat:
        run_turn(chat, "What is the capital of France?", SamplingConfig(max_new_tokens=10))
        cached = list(real_engine.token_ids)
        prompt = chat._conversation_ids(extra_user=follow_up, generation_prompt=True)
        uninterrupted = real_engine.sync_to(prompt)
        continuation = real_engine.tokenizer("The Louvre is")["input_ids"]
        uninterrupted_next = real_engine.score(continuation)
        real_engine.truncate(len(cached))

    real_engine.reset()  # drop every in-memory trace; only the disk remains
    with ChatSession.open(store, real_engine, session_id) as chat:
        assert chat.restore.tokens_restored == len(cached) and not chat.restore.rebuilt
        assert real_engine.token_ids == cached
        resumed = real_engine.sync_to(prompt)
        resumed_next = real_engine.score(continuation)
    torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=1e-4)
    torch.testing.assert_close(resumed_next, uninterrupted_next, rtol=0, atol=1e-4)


@pytest.mark.parametrize("damage,reason", [
    ("flip", "damaged"),
    ("truncate", "bytes"),
    ("delete", "missing"),
    ("foreign", "another model"),
])
def test_damaged_or_foreign_snapshots_are_detected_and_rebuilt(store, real_engine, two_turn_session, damage, reason):
    session_id, tokens = two_turn_session
    last = store.chunks(session_id)[-1]
    path = store.data_dir / last.file
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: last.size // 2])
    elif damage == "delete":
        path.unlink()
    else:
        signature = store.kv_signature(session_id)
        store.db["kv_signatures"].update(session_id, {"signature": json.dumps({**signature, "model_fingerprint": "x"})})
    with ChatSession.open(store, real_engine, session_id) as chat:
        assert chat.restore.rebuilt and reason in chat.restore.reason
        assert chat.restore.tokens_prefilled > 0
        assert len(chat.messages) == 4  # no message lost
        assert real_engine.num_tokens >= len(tokens) - 8
        run_turn(chat, "And of Spain?")  # it keeps working
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as chat:  # the rebuilt pool was saved again
        assert not chat.restore.rebuilt and chat.restore.tokens_restored == store.get(session_id).token_count


def test_a_chunk_damaged_inside_its_rows_is_cut_away_after_they_went_in(store, real_engine, two_turn_session):
    """A restore puts the rows in while their checksums are computed (sessions/restore.py, ChunkChecksums): a
    chunk whose header still parses but whose rows were damaged goes in, and is cut away with every chunk after
    it before anything uses them; what follows it is read again, as when the damage was found first."""
    session_id, tokens = two_turn_session
    chunks = store.chunks(session_id)  # two per turn: a prompt's, a reply's
    path = store.data_dir / chunks[2].file  # the second turn's prompt
    data = bytearray(path.read_bytes())
    header_bytes = int.from_bytes(data[:8], "little")
    first, last = json.loads(data[8 : 8 + header_bytes])["k.0"]["data_offsets"]
    data[8 + header_bytes + (first + last) // 2 + 1] ^= 0x7C  # a float16 key's high byte: the file still parses
    path.write_bytes(bytes(data))
    with ChatSession.open(store, real_engine, session_id) as chat:
        assert chat.restore.rebuilt and f"chunk {chunks[2].start}-{chunks[2].end} is damaged" in chat.restore.reason
        assert chat.restore.tokens_restored == chunks[2].start  # the first turn's rows only
        assert chat.restore.tokens_prefilled == real_engine.num_tokens - chunks[2].start > 0
        conversation = list(real_engine.token_ids)
        assert conversation[: chunks[2].end] == tokens[: chunks[2].end]
        keys = real_engine.pool.keys(0)[:, chunks[2].start :].clone()
    real_engine.reset()
    real_engine.prefill(conversation)
    # layer 0's keys depend on the tokens and positions alone: read again they are a fresh prefill's (a row
    # left from the chunk would be float16-rounded, and one of them damaged)
    torch.testing.assert_close(keys, real_engine.pool.keys(0)[:, chunks[2].start :], rtol=0, atol=1e-6)
    real_engine.reset()


def test_a_session_saved_under_the_models_older_fingerprint_is_taken_over_not_re_read(store, real_engine):
    """Versions before 2026-11-23 fingerprinted the model with its path and transformers version; their
    sessions of the same model restore (their chunks rewritten under the new signature), no re-read."""
    from infinigen_core.loading import legacy_model_fingerprint

    legacy = legacy_model_fingerprint(real_engine.model)
    assert legacy in real_engine.legacy_fingerprints and legacy != real_engine.fingerprint
    current = real_engine.fingerprint
    session_id = store.create("Old", system_prompt="You are a terse assistant.")
    real_engine.fingerprint = legacy  # the earlier version writes the session
    try:
        with ChatSession.open(store, real_engine, session_id) as chat:
            run_turn(chat, "What is the capital of France?")
            tokens = list(real_engine.token_ids)
    finally:
        real_engine.fingerprint = current
    old_files = [c.file for c in store.chunks(session_id)]
    assert store.kv_signature(session_id)["model_fingerprint"] == legacy
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as chat:
        assert not chat.restore.rebuilt and chat.restore.tokens_restored == len(tokens)
        assert real_engine.token_ids == tokens
    assert store.kv_signature(session_id) == real_engine.kv_signature()
    assert not any((store.data_dir / name).exists() for name in old_files)  # rewritten, the old files gone
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as chat:  # and they read as this version's own
        assert not chat.restore.rebuilt and chat.restore.tokens_restored == len(tokens)


def test_a_damaged_chunk_of_an_older_version_keeps_the_intact_ones_and_re_reads_the_rest(store, real_engine):
    from infinigen_core.loading import legacy_model_fingerprint

    current = real_engine.fingerprint
    session_id = store.create("Old and damaged")
    real_engine.fingerprint = legacy_model_fingerprint(real_engine.model)
    try:
        with ChatSession.open(store, real_engine, session_id) as chat:
            run_turn(chat, "What is the capital of France?")
            run_turn(chat, "And of Italy?")
            tokens = list(real_engine.token_ids)
    finally:
        real_engine.fingerprint = current
    chunks = store.chunks(session_id)
    (store.data_dir / chunks[2].file).unlink()  # the second turn's prompt chunk is gone
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as chat:
        assert chat.restore.tokens_restored == chunks[1].end  # the first turn came back from disk
        assert chat.restore.rebuilt and 0 < chat.restore.tokens_prefilled
        assert len(chat.messages) == 4 and real_engine.token_ids[: len(tokens) - 4] == tokens[: len(tokens) - 4]
    assert store.kv_signature(session_id) == real_engine.kv_signature()
    assert sorted(p.name for p in (store.data_dir / "kv" / session_id).iterdir()) == \
        sorted(Path(c.file).name for c in store.chunks(session_id))  # no stray files


def test_one_writer_per_session(store, real_engine, two_turn_session):
    session_id, _ = two_turn_session
    with ChatSession.open(store, real_engine, session_id):
        with pytest.raises(SessionLockedError, match="open elsewhere"):
            ChatSession.open(store, real_engine, session_id)
    ChatSession.open(store, real_engine, session_id).close()  # released on close


def test_regenerate_and_edit_truncate_and_reuse_the_prefix(store, real_engine, two_turn_session):
    session_id, tokens = two_turn_session
    with ChatSession.open(store, real_engine, session_id) as chat:
        last_user = chat.messages[-2]
        steps_before = real_engine.steps_run
        list(chat.regenerate(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3)))
        prefill_steps = [s for s in real_engine.history if s.step >= steps_before and not s.is_decode]
        assert sum(s.new_tokens for s in prefill_steps) <= 1  # the prompt was reused, not recomputed
        assert [m.role for m in chat.messages] == ["user", "assistant"] * 2
        assert real_engine.token_ids[: last_user.token_end] == tokens[: last_user.token_end]

        list(chat.edit_last_user("And of Germany?", SHORT))
        assert [m.content for m in chat.messages if m.role == "user"] == ["What is the capital of France?",
                                                                           "And of Germany?"]
        edited = list(real_engine.token_ids)
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as chat:
        assert real_engine.token_ids == edited and not chat.restore.rebuilt


def test_regenerate_keeps_the_old_reply_until_a_new_one_starts(store, real_engine, two_turn_session):
    import threading

    session_id, _ = two_turn_session
    with ChatSession.open(store, real_engine, session_id) as chat:
        old_reply = chat.messages[-1].content
        stopped = threading.Event()
        stopped.set()  # Stop pressed before the first token
        list(chat.regenerate(SHORT, cancel=stopped))
        assert [m.role for m in chat.messages] == ["user", "assistant"] * 2 and chat.messages[-1].content == old_reply
        events = list(chat.regenerate(SamplingConfig(max_new_tokens=6, temperature=1.0, seed=11)))
        assert [m.role for m in chat.messages] == ["user", "assistant"] * 2
        assert chat.messages[-1].content == events[-1].full_text


def test_branch_shares_the_prefix_chunks(store, real_engine, two_turn_session):
    session_id, tokens = two_turn_session
    first_reply = store.messages(session_id)[1]
    branch_id = store.branch(session_id, first_reply.id)
    assert [m.content for m in store.messages(branch_id)] == [m.content for m in store.messages(session_id)[:2]]
    shared = {c.file for c in store.chunks(branch_id)}
    assert shared and shared <= {c.file for c in store.chunks(session_id)}  # the same files, no copy
    store.delete(session_id)
    assert all((store.data_dir / f).exists() for f in shared)  # still used by the branch
    with ChatSession.open(store, real_engine, branch_id) as chat:
        assert not chat.restore.rebuilt and chat.restore.tokens_restored > 0
        run_turn(chat, "And of Spain?")
        assert len(chat.messages) == 4


def test_a_branch_from_a_question_shares_its_prompt_chunk(store, real_engine, two_turn_session):
    """Each turn is saved as its prompt's chunk and its reply's: a branch that keeps a question but not its
    answer reads none of the question again."""
    session_id, tokens = two_turn_session
    second_question = store.messages(session_id)[2]
    assert second_question.token_end in [c.end for c in store.chunks(session_id)]
    branch_id = store.branch(session_id, second_question.id)
    assert store.chunks(branch_id)[-1].end == second_question.token_end
    with ChatSession.open(store, real_engine, branch_id) as chat:
        assert chat.restore.tokens_restored == second_question.token_end
        read = []
        list(chat.regenerate(SHORT, None, lambda done, total: read.append(total)))  # answer the kept question
        assert read == [1]  # only the last prompt token is read again, for its logits


def test_export_import_round_trip(store, real_engine, two_turn_session, tmp_path):
    session_id, tokens = two_turn_session
    exported = store.export(session_id, tmp_path / "chat.igchat")
    other = SessionStore(tmp_path / "elsewhere")
    imported = other.import_file(exported)
    assert [m.content for m in other.messages(imported)] == [m.content for m in store.messages(session_id)]
    with ChatSession.open(other, real_engine, imported) as chat:
        assert not chat.restore.rebuilt and real_engine.token_ids == tokens


def test_export_of_a_damaged_session_leaves_out_the_bad_chunk_and_imports(store, real_engine, two_turn_session,
                                                                          tmp_path):
    session_id, tokens = two_turn_session
    *intact, last = store.chunks(session_id)
    damaged = bytearray((store.data_dir / last.file).read_bytes())
    damaged[-1] ^= 0xFF
    (store.data_dir / last.file).write_bytes(bytes(damaged))
    exported = store.export(session_id, tmp_path / "backup.igchat")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    other = SessionStore(tmp_path / "elsewhere")
    imported = other.import_file(exported)
    assert [c.end for c in other.chunks(imported)] == [c.end for c in intact]  # the intact prefix only
    assert [m.content for m in other.messages(imported)] == [m.content for m in store.messages(session_id)]
    with ChatSession.open(other, real_engine, imported) as chat:
        assert real_engine.token_ids == tokens[: intact[-1].end]
        run_turn(chat, "And of Spain?")  # the turns left out are re-read by the next turn
        assert len(chat.messages) == 6 and real_engine.token_ids[: len(tokens)] == tokens


def test_dropping_old_turns_is_one_transaction(store):
    session_id = store.create("Atomic")
    for index in range(4):
        store.add_message(session_id, "user" if index % 2 == 0 else "assistant", f"message {index}", index, index + 1)
    with pytest.raises(Exception):  # the second row cannot be stored: nothing may change at all
        store.replace_messages(session_id, [("user", "kept"), ("assistant", object())])
    assert [m.content for m in store.messages(session_id)] == [f"message {i}" for i in range(4)]
    store.replace_messages(session_id, [("user", "message 2"), ("assistant", "message 3")])
    first, second = store.messages(session_id)
    assert (first.content, first.position, first.token_start) == ("message 2", 0, -1)
    assert second.parent_id == first.id and second.position == 1


def _rewrite_archive(source: Path, target: Path, change) -> Path:
    with zipfile.ZipFile(source) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    change(entries)
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return target


def test_hostile_imports_are_refused_and_write_nothing(store, two_turn_session, tmp_path):
    session_id, _ = two_turn_session
    good = store.export(session_id, tmp_path / "good.igchat")
    manifest = lambda e: json.loads(e["manifest.json"])  # noqa: E731

    def traversal(e):
        e["../../evil.py"] = b"print('owned')"

    def bad_checksum(e):
        m = manifest(e)
        m["chunks"][0]["sha256"] = "0" * 64
        e["manifest.json"] = json.dumps(m).encode()

    def wrong_shape(e):  # a well-formed, correctly summed chunk whose layer-0 keys lost a head
        import hashlib

        from safetensors.torch import load, save

        from sessions.snapshots import chunk_metadata

        blob = e["chunks/000000.safetensors"]
        tensors = load(blob)
        tensors["k.0"] = tensors["k.0"][:2].contiguous()
        forged = save(tensors, metadata=chunk_metadata(blob))
        e["chunks/000000.safetensors"] = forged
        m = manifest(e)
        m["chunks"][0].update(size=len(forged), sha256=hashlib.sha256(forged).hexdigest())
        e["manifest.json"] = json.dumps(m).encode()

    def foreign_signature(e):
        m = manifest(e)
        m["signature"]["num_kv_heads"] = "4"
        e["manifest.json"] = json.dumps(m).encode()

    def pickle_chunk(e):
        import pickle

        payload = pickle.dumps({"k": 1})
        e["chunks/000000.safetensors"] = payload
        m = manifest(e)
        m["chunks"][0]["size"] = len(payload)
        e["manifest.json"] = json.dumps(m).encode()

    def bad_json(e):
        e["manifest.json"] = b"{not json"

    def huge_geometry(e):  # would make the shape check enumerate 10^8 tensor names
        m = manifest(e)
        m["signature"]["num_layers"] = "100000000"
        e["manifest.json"] = json.dumps(m).encode()

    def unicode_digits(e):  # "²" passes str.isdigit() but int() refuses it
        m = manifest(e)
        m["signature"]["head_dim"] = "\u00b2"
        e["manifest.json"] = json.dumps(m).encode()

    cases = {traversal: "unexpected", bad_checksum: "checksum", wrong_shape: "shape", pickle_chunk: "checksum",
             bad_json: "JSON", foreign_signature: "another num kv heads", huge_geometry: "KV geometry",
             unicode_digits: "KV geometry"}
    other = SessionStore(tmp_path / "target")
    for change, message in cases.items():
        hostile = _rewrite_archive(good, tmp_path / f"{change.__name__}.igchat", change)
        with pytest.raises(ImportValidationError, match=message):
            other.import_file(hostile)
    (tmp_path / "plain.txt").write_text("hello")
    with pytest.raises(ImportValidationError, match="not a session export"):
        other.import_file(tmp_path / "plain.txt")
    bad_crc = bytearray(good.read_bytes())  # one flipped byte in a stored chunk: the zip's CRC no longer holds
    bad_crc[len(bad_crc) // 2] ^= 0xFF
    (tmp_path / "bad_crc.igchat").write_bytes(bytes(bad_crc))
    # (a byte that lands in a chunk's safetensors header is told by the header check, which runs before the data)
    with pytest.raises(ImportValidationError, match="damaged|checksum|unreadable header"):
        other.import_file(tmp_path / "bad_crc.igchat")
    assert other.list() == [] and not (tmp_path / "target" / "kv").exists()
    assert not (tmp_path / "evil.py").exists() and not (tmp_path.parent / "evil.py").exists()


def test_the_window_is_checked_before_generation(store, real_engine):
    session_id = store.create("Long")
    with ChatSession.open(store, real_engine, session_id) as chat:
        run_turn(chat, "Hello!")
        run_turn(chat, "How are you?")
        huge = "word " * 8150
        check = chat.check_window(huge)
        assert not check.fits and check.window == 8192 and check.droppable_turns == 1
        with pytest.raises(ContextWindowError, match="drop the oldest turns"):
            list(chat.send(huge))
        assert len(chat.messages) == 4  # nothing was stored or lost
        with pytest.raises(ContextWindowError):
            chat.drop_oldest_turns(huge)  # even without old turns it cannot fit
        base = chat.check_window("word " * 7000).needed_tokens  # " word" is one token per repeat
        medium = "word " * (7000 + 8192 - base + 1)
        assert chat.check_window(medium).needed_tokens == 8193
        assert chat.drop_oldest_turns(medium) == 1
        assert [m.content for m in chat.messages] == ["How are you?", chat.messages[1].content]
        assert chat.check_window(medium).fits


def kill_worker_at(store, session_id, mode, marker):
    """Run tests/session_worker.py, SIGKILL it when it prints `marker`; returns its first turn's tokens."""
    worker = subprocess.Popen([sys.executable, str(ROOT / "tests" / "session_worker.py"), str(store.data_dir),
                               session_id, mode], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    turn1_tokens = None
    try:
        for line in worker.stdout:
            if line.startswith("TURN1 DONE"):
                turn1_tokens = int(line.split()[-1])
            if line.startswith(marker):
                break
        else:
            pytest.fail(f"the worker ended without printing {marker}")
        assert turn1_tokens, "the worker did not finish its first turn"
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    return turn1_tokens


def test_kill_9_during_a_snapshot_write_keeps_every_message(store, real_engine):
    session_id = store.create("Crash while saving")
    turn1_tokens = kill_worker_at(store, session_id, "snapshot", "SNAPSHOT WRITING")
    folder = store.data_dir / "kv" / session_id
    leftovers = [p for p in folder.iterdir() if ".tmp-" in p.name]
    assert leftovers, "the worker was not killed inside the chunk write"

    reopened = SessionStore(store.data_dir)
    with ChatSession.open(reopened, real_engine, session_id) as chat:
        # both replies were committed; only the second turn's KV rows were in flight
        assert [m.role for m in chat.messages] == ["user", "assistant", "user", "assistant"]
        assert not chat.restore.rebuilt and chat.restore.tokens_restored == turn1_tokens
        assert not any(".tmp-" in p.name for p in folder.iterdir())  # the torn write is cleaned up
        run_turn(chat, "And of Spain?")
        conversation = chat._conversation_ids(chat.messages[:-1], generation_prompt=True)  # up to the reply
        assert real_engine.token_ids[: len(conversation)] == conversation  # the lost rows were recomputed
        chunks = reopened.chunks(session_id)
        assert [c.start for c in chunks] == [0] + [c.end for c in chunks[:-1]]
        assert chunks[-1].end == real_engine.num_tokens == reopened.get(session_id).token_count


@pytest.mark.parametrize("damage", ["garbage", "foreign"])
def test_a_damaged_or_foreign_database_is_refused_clearly_and_left_alone(tmp_path, damage):
    import sqlite3

    from sessions import SessionError

    data = tmp_path / "data"
    data.mkdir()
    database = data / "sessions.db"
    if damage == "garbage":
        database.write_bytes(b"this is not an SQLite file, just some bytes" * 100)
    else:
        with sqlite3.connect(database) as other:
            other.execute("CREATE TABLE sessions (id TEXT, name TEXT)")
    before = database.read_bytes()
    with pytest.raises(SessionError, match="damaged or is not InfiniGen Chat's.*move it aside"):
        SessionStore(data)
    assert database.read_bytes() == before


def test_a_database_from_before_the_origin_column_opens_and_gains_it(tmp_path):
    store = SessionStore(tmp_path)
    old = store.create("older chat")
    store.db.execute("ALTER TABLE sessions DROP COLUMN origin")  # as an earlier version wrote it
    store.db.conn.close()
    reopened = SessionStore(tmp_path)
    assert reopened.get(old).origin == "app"
    assert reopened.get(reopened.create("from a script", origin="api")).origin == "api"
    with pytest.raises(ValueError, match="origin"):
        reopened.create("x", origin="elsewhere")


def test_the_longest_stored_token_prefix_is_found_across_sessions(store):
    """Matching reads the token ids the chunks hold; a chunk that only starts alike counts in part."""
    from sessions.prefix import PrefixFinder
    from sessions.snapshots import write_chunk

    signature = {"model_fingerprint": "m", "dtype": "float32", "num_layers": "0", "num_kv_heads": "1",
                 "head_dim": "1", "skew": "none"}

    def session_with(*chunks):
        session_id, start = store.create("s"), 0
        for ids in chunks:
            record = write_chunk(store.data_dir, session_id, {"token_ids": torch.tensor(ids)}, signature, start)
            start += len(ids)
            store.add_chunk(session_id, record, signature, start)
        return session_id

    short = session_with([1, 2, 3])
    long = session_with([1, 2, 3, 4], [5, 6, 7, 8])
    session_with([9, 9, 9, 9, 9, 9])
    finder = PrefixFinder(store)
    match = finder.longest(signature, [1, 2, 3, 4, 5, 6, 0, 0])
    assert (match.session_id, match.tokens) == (long, 6) and [c.end for c in match.chunks] == [4, 8]
    assert finder.longest(signature, [1, 2, 7]).tokens == 2  # both agree on two tokens: either serves
    assert finder.longest(signature, [8, 8]).session_id is None
    assert finder.longest({**signature, "skew": "other"}, [1, 2, 3]).session_id is None  # another model's KV
    assert finder.stored_prefix(short, [1, 2, 3, 4]).tokens == 3


def test_extend_stores_a_clients_messages_in_one_go_and_answers_the_whole_conversation(store, real_engine):
    session_id = store.create("api", "You are terse.", origin="api")
    with ChatSession.open(store, real_engine, session_id) as chat:
        turns = [("user", "What is the capital of France?"), ("assistant", "Paris."), ("user", "And of Italy?")]
        reply = list(chat.extend(turns, SHORT))[-1].full_text
        messages = chat.messages
        assert [(m.role, m.content) for m in messages] == turns + [("assistant", reply)]
        assert messages[0].token_start > 0 and messages[-1].token_end == real_engine.num_tokens
        # each message's span, as the conversation up to it tokenizes (the tokenizations made together)
        tokenizer = real_engine.tokenizer
        ends = [len(chat_token_ids(tokenizer, conversation("You are terse.", turns[:count]), False))
                for count in range(len(turns) + 1)]
        prompt = len(chat_token_ids(tokenizer, conversation("You are terse.", turns), add_generation_prompt=True))
        assert [(m.token_start, m.token_end) for m in messages[:3]] == [(ends[0], ends[1]), (ends[1], ends[2]),
                                                                        (ends[2], prompt)]
        with pytest.raises(ContextWindowError):
            list(chat.extend([("user", "word " * 9000)], SHORT))
        assert len(chat.messages) == 4  # refused before anything was stored
