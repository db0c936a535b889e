"""Chunks set aside under the model that wrote them: a session opened under another model parks its chunks
(keyed by their KV signature) instead of dropping them, and switching back to that model brings them back, so
the conversation restores from disk instead of being re-read.

    store.parked.park(session_id)                     # before the session's KV is rebuilt under another model
    store.parked.unpark(session_id, engine.kv_signature())
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import SessionStore


def signature_key(signature: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


def _locked(method):
    """Under the store's lock, as every use of its one connection is."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.store._lock:
            return method(self, *args, **kwargs)

    return wrapper


class ParkedChunks:
    def __init__(self, store: "SessionStore") -> None:
        self.store = store

    @_locked
    def park(self, session_id: str) -> int:
        """Set the session's chunks aside under their model's signature (replacing an older set of the same
        signature); the session is left with none. Returns how many were parked."""
        db, signature, chunks = self.store.db, self.store.kv_signature(session_id), self.store.chunks(session_id)
        if signature is None or not chunks:
            return 0
        key = signature_key(signature)
        replaced = [r["file"] for r in db.query(
            "SELECT file FROM parked_chunks WHERE session_id = ? AND signature_key = ?", [session_id, key])]
        with db.atomic():
            db.execute("DELETE FROM parked_chunks WHERE session_id = ? AND signature_key = ?", [session_id, key])
            for chunk in chunks:
                db.table("parked_chunks").insert({"session_id": session_id, "signature_key": key,
                                            "signature": json.dumps(signature), **chunk.__dict__})
            db.execute("DELETE FROM chunks WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM kv_signatures WHERE session_id = ?", [session_id])
        self.store.remove_unreferenced(replaced)
        return len(chunks)

    @_locked
    def unpark(self, session_id: str, signature: dict[str, str]) -> int:
        """Bring back the chunks parked under `signature` as the session's chunks (it must have none).
        Returns how many came back (0: none were parked for that model)."""
        db, key = self.store.db, signature_key(signature)
        rows = list(db.query("SELECT * FROM parked_chunks WHERE session_id = ? AND signature_key = ? ORDER BY start",
                             [session_id, key]))
        if not rows or self.store.chunks(session_id):
            return 0
        with db.atomic():
            for row in rows:
                db.table("chunks").insert({k: row[k] for k in ("session_id", "start", "end", "file", "sha256", "size")})
            db.table("kv_signatures").upsert({"session_id": session_id, "signature": json.dumps(signature)},
                                       pk="session_id")
            db.execute("DELETE FROM parked_chunks WHERE session_id = ? AND signature_key = ?", [session_id, key])
        return len(rows)

    @_locked
    def models(self, session_id: str) -> list[str]:
        """Model fingerprints whose KV chunks this session keeps parked."""
        rows = self.store.db.query("SELECT DISTINCT signature FROM parked_chunks WHERE session_id = ?", [session_id])
        return sorted(json.loads(r["signature"]).get("model_fingerprint", "?") for r in rows)
