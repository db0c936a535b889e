"""A session's KV chunks on disk kept in step with the engine: what is saved, what to write next, and the one
chunk that may be on its way to the disk in the background.

    chunks = SessionChunks(store, session_id)
    chunks.persist(engine, boundary=len(prompt_ids), background=True)   # the first token does not wait
    chunks.persist(engine, boundary=len(prompt_ids))    # at the turn's end: waits for the one above first
    chunks.wait()                                       # before a reload or a close

Rows are copied out of the engine by the caller's thread (the engine is not thread-safe); only their int8
encoding, the file and the database row run on the background thread. Chunks are added in order, one writer
at a time: every persist waits for the pending write first.
"""

from __future__ import annotations

import logging

from infinigen_core.prefix import common_prefix_length

from .background import BackgroundWrite
from .budget import enforce_disk_limit
from .snapshots import write_chunk
from .store import SessionStore

log = logging.getLogger("infinigen.sessions")
Piece = tuple[int, int, dict]  # (start, end, exported rows)


class SessionChunks:
    def __init__(self, store: SessionStore, session_id: str) -> None:
        self.store, self.id = store, session_id
        self.saved_ids: list[int] = []  # token ids the chunks on disk hold (or will, once `wait` returns), in order
        self._pending: BackgroundWrite | None = None

    def wait(self) -> None:
        """Wait for the chunk being written in the background. If it failed, its rows count as unsaved again
        (the next persist writes them); the turn it belongs to has already gone on, so the error is logged."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending.wait()
        if error is not None:
            log.warning("a KV chunk of session %s could not be written (%s): its rows are written again with the "
                        "next chunk", self.id, error)
            self._forget_unsaved()

    def _forget_unsaved(self) -> None:
        """Make `saved_ids` what the store's chunks hold (after a write that did not complete, or a drop)."""
        chunks = self.store.chunks(self.id)
        self.saved_ids = self.saved_ids[: chunks[-1].end if chunks else 0]

    def persist(self, engine, boundary: int | None = None, background: bool = False) -> None:
        """Append a chunk with the tokens the disk does not hold yet, split in two at `boundary` (where a
        turn's prompt ends and its reply begins, so a branch or another reply to the same prompt can share
        the prompt's chunk); drop chunks the cache no longer has. With `background` the rows' encoding and
        writing run on another thread (`wait`)."""
        self.wait()
        ids = engine.token_ids
        common = common_prefix_length(self.saved_ids, ids)
        if common < len(self.saved_ids):
            self.store.drop_chunks_from(self.id, common)
            self._forget_unsaved()
        start = len(self.saved_ids)
        if start >= len(ids):
            self.store.update(self.id, token_count=len(ids))
            return
        ends = [boundary] if boundary is not None and start < boundary < len(ids) else []
        pieces: list[Piece] = []
        for end in ends + [len(ids)]:
            pieces.append((start, end, engine.export_rows(start, end)))
            start = end
        signature, self.saved_ids = engine.kv_signature(), list(ids)
        if background:
            self._pending = BackgroundWrite(lambda: self._write(pieces, signature))
            return
        try:
            self._write(pieces, signature)
        except BaseException:
            self._forget_unsaved()
            raise

    def _write(self, pieces: list[Piece], signature: dict[str, str]) -> None:
        """Encode and write exported rows as chunks, in order, each registered once its file is durable."""
        for start, end, rows in pieces:
            record = write_chunk(self.store.data_dir, self.id, rows, signature, start, self.store.storage.kv_format)
            self.store.add_chunk(self.id, record, signature, end)
        enforce_disk_limit(self.store)  # this session holds its lock, so only other sessions' chunks can go
