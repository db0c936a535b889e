"""Which stored session's KV cache shares the longest token prefix with a conversation about to be read.

    finder = PrefixFinder(store)
    match = finder.longest(engine.kv_signature(), prompt_ids)
    if match.tokens: ...  # match.session_id's chunks cover prompt_ids[:match.tokens]

Matching is by the token ids the chunks hold, which are exactly what their KV rows were computed from.
Chunk files are named by their content's digest and never rewritten, so a finder keeps their token ids
in memory after the first read (8 bytes a token); only the ids tensor is read, not the K/V rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from .snapshots import ChunkRecord
from .store import SessionStore


@dataclass(frozen=True)
class PrefixMatch:
    session_id: str | None
    tokens: int  # how many leading tokens of the conversation that session's chunks hold
    chunks: tuple[ChunkRecord, ...]  # its chunks that cover them, the last one possibly only in part


NO_MATCH = PrefixMatch(None, 0, ())


class PrefixFinder:
    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._ids_by_file: dict[str, torch.Tensor | None] = {}
        self._lock = threading.Lock()

    def chunk_token_ids(self, record: ChunkRecord) -> torch.Tensor | None:
        """The token ids a chunk holds (None when its file cannot be read: then it matches nothing)."""
        with self._lock:
            if record.file in self._ids_by_file:
                return self._ids_by_file[record.file]
        try:
            with safe_open(str(self.store.data_dir / record.file), framework="pt") as chunk:
                ids = chunk.get_tensor("token_ids")
        except (OSError, SafetensorError, KeyError, ValueError, RuntimeError):
            ids = None
        if ids is not None and (ids.dim() != 1 or ids.numel() != record.end - record.start):
            ids = None
        with self._lock:
            self._ids_by_file[record.file] = ids
        return ids

    def stored_prefix(self, session_id: str, token_ids: list[int]) -> PrefixMatch:
        """How far `session_id`'s chunks agree with `token_ids`, from the first token on."""
        wanted = torch.tensor(token_ids, dtype=torch.int64)
        matched, used = 0, []
        for record in self.store.chunks(session_id):
            if record.start != matched or matched >= len(token_ids):
                break
            ids = self.chunk_token_ids(record)
            if ids is None:
                break
            overlap = min(len(ids), len(token_ids) - record.start)
            differ = (ids[:overlap] != wanted[record.start:record.start + overlap]).nonzero()
            same = int(differ[0]) if len(differ) else overlap
            if same == 0:
                break
            used.append(record)
            matched += same
            if same < len(ids):
                break
        return PrefixMatch(session_id, matched, tuple(used)) if matched else NO_MATCH

    def longest(self, signature: dict[str, str], token_ids: list[int]) -> PrefixMatch:
        """The session (made with this KV signature) whose chunks share the most leading tokens with
        `token_ids`; the most recently used one among equals."""
        best = NO_MATCH
        for summary in self.store.list():  # most recent first: a later equal match does not replace it
            if not summary.token_count or self.store.kv_signature(summary.id) != signature:
                continue
            match = self.stored_prefix(summary.id, token_ids)
            if match.tokens > best.tokens:
                best = match
        return best
