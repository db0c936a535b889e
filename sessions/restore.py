"""Which of a session's KV chunks a restore reads back, and why the conversation must be re-read anyway.

ChatSession._restore (chat.py) reads the chunks this chooses, then re-reads what they do not hold:

    choice = which_chunks(store, session_id, engine)     # this model's own chunks, legacy ones re-signed
    checksums = ChunkChecksums()                         # computed while the rows go into the pool
    rows, end, problem = read_chunks(store, choice, engine.kv_signature(), progress, engine.partial_key_digests(),
                                     checksums)
    restored = engine.import_rows(rows)
    bad = checksums.first_damaged()                      # before anything uses the rows: cut back to a damaged one
    problem = problem or missing_cache(store, session_id, restored, choice)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .snapshots import (
    ChunkError,
    ChunkRecord,
    checksum_matches,
    damage_reason,
    map_chunk,
    parse_chunk,
    resign_chunk,
)
from .store import SessionStore

Progress = Callable[[int, int], None]
FOREIGN_CACHE = ("the conversation was last read by another model or precision (its KV cache is kept for when "
                 "you switch back), so this model reads it anew")


@dataclass(frozen=True)
class ChunkChoice:
    """The chunks a restore reads, and why the conversation is re-read whatever they hold ("" when it is not)."""

    records: list[ChunkRecord]
    problem: str
    unparked: bool  # this model's own chunks from an earlier visit, brought back


def which_chunks(store: SessionStore, session_id: str, engine) -> ChunkChoice:
    """The session's chunks that `engine`'s model can read: its own (an earlier version's re-signed), or its own
    from an earlier visit brought back; another model's are set aside for when it comes back, never dropped."""
    signature = engine.kv_signature()
    stored = store.kv_signature(session_id)
    if stored in engine.legacy_kv_signatures():
        _take_over_legacy_chunks(store, session_id, stored, signature)
        stored = signature
    problem = ""
    if store.chunks(session_id) and stored != signature:
        store.parked.park(session_id)
        problem = FOREIGN_CACHE
    unparked = not store.chunks(session_id) and store.parked.unpark(session_id, signature) > 0
    if unparked:
        problem = ""  # this model's own cache from an earlier visit
    return ChunkChoice(store.chunks(session_id), problem, unparked)


class ChunkChecksums:
    """The SHA-256 of the chunks a restore reads, computed on a thread of their own while their rows go into the
    pool (hashlib lets go of the interpreter; at 32k tokens of Gemma 3 the 449 MB chunk's checksum took 0.25 s
    of a 0.96 s reopen). Nothing the rows hold is used before `first_damaged` has answered: the restore
    truncates the pool back to the first damaged chunk and reads the rest again, as a chunk found damaged before
    its rows went in would have been."""

    def __init__(self) -> None:
        self._pending: list[tuple[ChunkRecord, Future[bool]]] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-checksums")

    def add(self, record: ChunkRecord, data: memoryview) -> None:
        self._pending.append((record, self._worker.submit(checksum_matches, data, record)))

    def first_damaged(self) -> ChunkRecord | None:
        """The first chunk, in order, whose bytes do not have their checksum (waits for them)."""
        try:
            return next((record for record, matches in self._pending if not matches.result()), None)
        finally:
            self._pending = []
            self._worker.shutdown(wait=False, cancel_futures=True)


def read_chunks(store: SessionStore, choice: ChunkChoice, signature: dict[str, str],
                progress: Progress | None, partial_keys: dict[int, str] | None,
                checksums: ChunkChecksums) -> tuple[list, int, str]:
    """The chosen chunks' rows in order, up to the first missing or unusable one: (rows, the token where they
    end, why the rest could not be read or else the choice's own problem). `partial_keys`: the engine's
    partial_key_digests, whose saved partial keys the rows keep (snapshots.parse_chunk). Each chunk's checksum is
    left to `checksums` (the caller asks `first_damaged` before it uses the rows); a chunk that does not parse is
    still called damaged where its checksum does not match."""
    tensors, expected_start, problem = [], 0, choice.problem
    for record in choice.records:
        try:
            if record.start != expected_start:
                raise ChunkError(f"chunk {expected_start}-{record.start} is missing")
            tensors.append(_read_checked_later(store, record, signature, partial_keys, checksums))
        except ChunkError as error:
            problem = str(error)
            break
        expected_start = record.end
        if progress is not None:
            progress(expected_start, choice.records[-1].end)
    return tensors, expected_start, problem


def _read_checked_later(store: SessionStore, record: ChunkRecord, signature: dict[str, str],
                        partial_keys: dict[int, str] | None, checksums: ChunkChecksums) -> dict:
    data = map_chunk(store.data_dir, record, checksum=False)
    try:
        rows = parse_chunk(data, signature, record.start, record.end, partial_keys)
    except ChunkError:
        if not checksum_matches(data, record):
            raise ChunkError(damage_reason(record)) from None
        raise
    checksums.add(record, data)
    return rows


def missing_cache(store: SessionStore, session_id: str, restored: int, choice: ChunkChoice) -> str:
    """Why the conversation must be re-read although every chosen chunk read well: its cache was not all on
    disk. (A cache brought back from an earlier visit is measured against the conversation itself, by the
    caller, not against the token count that the other model wrote.)"""
    summary = store.get(session_id)
    if choice.unparked or not summary.message_count or restored >= max(summary.token_count, 1):
        return ""
    return ("its KV cache was dropped to stay within the disk limit" if summary.kv_dropped
            else "its KV cache was not on disk")


def _take_over_legacy_chunks(store: SessionStore, session_id: str, old: dict[str, str], new: dict[str, str]) -> None:
    """Chunks an earlier version saved for this same model under its older fingerprint: each is checked and
    rewritten under the current signature, so the session restores instead of being re-read."""
    written: list[ChunkRecord] = []
    for record in store.chunks(session_id):
        try:
            written.append(resign_chunk(store.data_dir, session_id, record, old, new))
        except ChunkError:  # damaged or missing: keep the intact chunks before it; the rest is re-read
            break
    store.replace_chunks(session_id, written, new)
