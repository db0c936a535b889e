"""A session's KV chunks on disk kept in step with the engine: what is saved, what to write next, and the one
chunk that may be on its way to the disk in the background.

    chunks = SessionChunks(store, session_id)
    chunks.persist(engine, boundary=len(prompt_ids), background=True)   # the first token does not wait
    chunks.stream(engine)                               # while the reply streams: its rows so far, unless busy
    chunks.persist(engine, boundary=len(prompt_ids))    # at the turn's end: waits for the one above first
    chunks.wait()                                       # before a reload or a close

Rows are copied out of the engine by the caller's thread (the engine is not thread-safe); only their int8
encoding, the file and the database row run on the background thread. Chunks are added in order, one writer
at a time: every persist waits for the pending write first.

The chunks `stream` writes are stand-ins for a crash: the turn's end writes the reply whole as one chunk and
swaps it for them, so a finished turn leaves one chunk for its prompt and one for its reply whether or not it
streamed (branches and shared prefixes see the same layout as before). Stand-ins are written in the exact
format, whatever the store's: the reply is encoded once, at its end, and the background thread beside the
decode only copies bytes (an int8 encode there is torch work on the decode's cores, thrown away at the end).
"""

from __future__ import annotations

import logging

from infinigen_core.prefix import common_prefix_length

from .background import BackgroundWrite
from .budget import enforce_disk_limit
from .snapshots import holds_partial_keys, write_chunk
from .store import SessionStore

log = logging.getLogger("infinigen.sessions")
Piece = tuple[int, int, dict]  # (start, end, exported rows)
# a streaming reply's rows are written once at least this many have come (where decoding is slow, one chunk,
# fsync and commit per token would be the disk's busiest way to save a few tokens)
STREAM_MIN_TOKENS = 16
STAND_IN_FORMAT = "exact"  # see the module's docstring


class SessionChunks:
    def __init__(self, store: SessionStore, session_id: str) -> None:
        self.store, self.id = store, session_id
        self.saved_ids: list[int] = []  # token ids the chunks on disk hold (or will, once `wait` returns), in order
        self._pending: BackgroundWrite | None = None
        self._pending_swaps = False  # whether the pending write is a persist's, which swaps the stand-ins
        # where the chunks `stream` wrote begin (None: there are none); cleared only once a persist's write has
        # swapped them, so a write that fails, in the background or not, leaves them marked for the next one
        self._stand_ins_from: int | None = None

    def wait(self) -> None:
        """Wait for the chunk being written in the background. If it failed, its rows count as unsaved again
        (the next persist writes them) and stand-ins it was to swap stay marked (the next persist swaps them);
        the turn it belongs to has already gone on, so the error is logged."""
        pending, self._pending = self._pending, None
        swaps, self._pending_swaps = self._pending_swaps, False
        if pending is None:
            return
        error = pending.wait()
        if error is None:
            if swaps:
                self._stand_ins_from = None
            return
        log.warning("a KV chunk of session %s could not be written (%s): its rows are written again with the "
                    "next chunk", self.id, error)
        self._forget_unsaved()

    def _forget_unsaved(self) -> None:
        """Make `saved_ids` what the store's chunks hold (after a write that did not complete, or a drop)."""
        chunks = self.store.chunks(self.id)
        self.saved_ids = self.saved_ids[: chunks[-1].end if chunks else 0]

    def stream(self, engine) -> bool:
        """While a reply streams: write the rows the disk does not hold yet in the background, as a stand-in
        chunk that the turn's end (`persist`) replaces. Does nothing while the last write is still under way
        (the decode loop never waits for the disk) or fewer than STREAM_MIN_TOKENS rows are new. Returns
        whether a write was started."""
        if self._pending is not None and not self._pending.done():
            return False
        self.wait()  # collects the finished write (a failure makes its rows unsaved again)
        if engine.num_tokens - len(self.saved_ids) < STREAM_MIN_TOKENS:
            return False
        if self._stand_ins_from is None:
            self._stand_ins_from = len(self.saved_ids)
        self._append(engine, None, background=True, kv_format=STAND_IN_FORMAT)
        return True

    def persist(self, engine, boundary: int | None = None, background: bool = False) -> None:
        """Append a chunk with the tokens the disk does not hold yet, split in two at `boundary` (where a
        turn's prompt ends and its reply begins, so a branch or another reply to the same prompt can share
        the prompt's chunk); drop chunks the cache no longer has. With `background` the rows' encoding and
        writing run on another thread (`wait`). Stand-in chunks that `stream` wrote are rewritten as one."""
        self.wait()
        # a failure raised here or met by `wait` keeps the stand-ins marked: the next persist swaps them (a swap
        # is one transaction, so they are on disk until it commits)
        self._append(engine, boundary, background, self._stand_ins_from)
        if self._pending is None:
            self._stand_ins_from = None  # written, or nothing was left to write
        else:
            self._pending_swaps = True

    def _append(self, engine, boundary: int | None, background: bool, rewrite_from: int | None = None,
                kv_format: str | None = None) -> None:
        ids = engine.token_ids
        common = common_prefix_length(self.saved_ids, ids)
        if common < len(self.saved_ids):
            self.store.drop_chunks_from(self.id, common)
            self._forget_unsaved()
        start = len(self.saved_ids) if rewrite_from is None else min(len(self.saved_ids), rewrite_from)
        if start >= len(ids):
            self.store.update(self.id, token_count=len(ids))
            return
        ends = [boundary] if boundary is not None and start < boundary < len(ids) else []
        kv_format = kv_format or self.store.storage.kv_format
        # only the earlier int8 format (/4, the benchmark's int8-partial-keys) holds partial keys (snapshots.py)
        partial_keys = engine.partial_key_digests() if holds_partial_keys(kv_format) else None
        pieces: list[Piece] = []
        for end in ends + [len(ids)]:
            pieces.append((start, end, engine.export_rows(start, end, partial_keys=bool(partial_keys))))
            start = end
        signature, self.saved_ids = engine.kv_signature(), list(ids)
        if background:
            self._pending = BackgroundWrite(lambda: self._write(pieces, signature, kv_format, partial_keys))
            return
        try:
            self._write(pieces, signature, kv_format, partial_keys)
        except BaseException:
            self._forget_unsaved()
            raise

    def _write(self, pieces: list[Piece], signature: dict[str, str], kv_format: str,
               partial_keys: dict[int, str] | None) -> None:
        """Encode and write exported rows as chunks, in order, each registered once its file is durable; chunks
        on disk from a piece's start on (stand-ins) are swapped for it, with the session's token count, in one
        transaction."""
        for start, end, rows in pieces:
            record = write_chunk(self.store.data_dir, self.id, rows, signature, start, kv_format, partial_keys)
            stored = self.store.chunks(self.id)
            kept = [chunk for chunk in stored if chunk.start < start]
            if len(kept) == len(stored):
                self.store.add_chunk(self.id, record, signature, end)
            else:  # stand-ins from `stream`: a crash now leaves them or this chunk, never neither
                self.store.replace_chunks(self.id, kept + [record], signature, token_count=end)
        enforce_disk_limit(self.store)  # this session holds its lock, so only other sessions' chunks can go
