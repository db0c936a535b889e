"""The session database: sessions, their messages and their KV chunks, in one SQLite file.

    store = SessionStore()                      # ~/.local/share/infinigen-chat/sessions.db
    session_id = store.create("Trip planning", system_prompt="You are concise.")
    for summary in store.list(): print(summary.title, summary.token_count)
    for hit in store.search("paris train"): print(hit.title, hit.snippet)   # full-text, newest first

The database keeps its own full-text index of titles, messages and attachment names (sessions/search.py):
SQLite triggers update it in the same transaction as every write, and a database saved before it existed
gets it on its first open (`SessionStore(..., index_progress=callback)` reports that build's progress).

Chunk files live beside the database (kv/<session>/...). A branch shares its parent's chunk files; a
file is removed only when no session refers to it any more. `store.storage` says in which format new
chunks are written and how much disk all chunks may take (sessions/budget.py keeps them under it).

A session's chunks belong to the model (its KV signature) that wrote them. Opened under another model,
they are parked (`store.parked.park`, sessions/parking.py), not dropped, keyed by their signature; switching
back to that model brings them back (`store.parked.unpark`), so the conversation restores from disk instead of being re-read.
"""

from __future__ import annotations

import builtins
import functools
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from .errors import SessionNotFoundError
from .lock import session_lock
from .parking import ParkedChunks
from .paths import default_data_dir
from .schema import ORIGINS, open_database
from .search import ProgressCallback, SearchHit, search_sessions
from .snapshots import ChunkRecord
from .storage import StorageConfig

if TYPE_CHECKING:
    from .archive import ImportLimits

DB_NAME = "sessions.db"


def _locked(method):
    """Serialise use of the one connection: the app calls the store from Gradio's worker threads, and a read
    must not see another thread's transaction half-done."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class SessionSummary:
    id: str
    title: str
    system_prompt: str
    created: float
    updated: float
    model_fingerprint: str
    settings: dict
    token_count: int
    message_count: int
    bytes_on_disk: int  # of its KV chunks, parked ones included (files shared with a branch count for both)
    origin: str = "app"  # "app" (the page, an import) or "api" (an OpenAI-API client's conversation)
    kv_tokens: int = 0  # tokens its chunks on disk cover, from position 0
    last_used: float = 0.0  # last opened or changed: the disk budget drops the least recent first
    kv_dropped: bool = False  # its chunks went to keep within the disk budget

    @property
    def reopens_instantly(self) -> bool:
        """Its KV cache is on disk in full (or it has no text yet): opening it reads chunks, not the text."""
        return self.message_count == 0 or 0 < self.token_count <= self.kv_tokens


@dataclass(frozen=True)
class Message:
    id: int
    role: str  # "user" | "assistant"
    content: str
    position: int  # order within the session
    token_start: int  # span of the message in the session's token sequence
    token_end: int
    created: float
    parent_id: int | None  # the message this one answers or follows
    # files attached to it: their metadata (documents.attachment_record), whose text `content` holds
    attachments: tuple[dict, ...] = ()


class SessionStore:
    def __init__(self, data_dir: Path | str | None = None, storage: StorageConfig | None = None,
                 index_progress: ProgressCallback | None = None) -> None:
        self.data_dir = Path(data_dir).expanduser() if data_dir else default_data_dir()
        self.storage = storage or StorageConfig()
        # (used, limit) bytes while the open sessions alone keep the KV chunks over the disk limit (budget.py)
        self.over_disk_limit: tuple[int, int] | None = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # one connection shared by the app's threads; every use is serialised by _lock
        self.db = open_database(self.data_dir / DB_NAME, index_progress)
        self.parked = ParkedChunks(self)

    # ------------------------------------------------------------------ sessions
    @_locked
    def create(self, title: str = "New chat", system_prompt: str = "", settings: dict | None = None,
               fingerprint: str = "", origin: str = "app") -> str:
        if origin not in ORIGINS:
            raise ValueError(f"a session's origin is one of {', '.join(ORIGINS)}, got {origin!r}")
        session_id = uuid.uuid4().hex[:16]
        now = time.time()
        self.db.table("sessions").insert({
            "id": session_id, "title": title.strip() or "New chat", "system_prompt": system_prompt,
            "created": now, "updated": now, "model_fingerprint": fingerprint,
            "settings": json.dumps(settings or {}), "token_count": 0, "origin": origin,
        })
        return session_id

    @_locked
    def get(self, session_id: str) -> SessionSummary:
        rows = list(self.db.query(_SUMMARY_SQL + " WHERE s.id = ?", [session_id]))
        if not rows:
            raise SessionNotFoundError(f"no session with id {session_id!r} (it may have been deleted)")
        return self._summary(rows[0])

    @_locked
    def list(self) -> builtins.list[SessionSummary]:
        """Every session, most recently changed first: one query, whatever the number of sessions."""
        rows = self.db.query(_SUMMARY_SQL + " ORDER BY s.updated DESC")
        return [self._summary(row) for row in rows]

    @staticmethod
    def _summary(row: dict) -> SessionSummary:
        return SessionSummary(
            id=row["id"], title=row["title"], system_prompt=row["system_prompt"] or "", created=row["created"],
            updated=row["updated"], model_fingerprint=row["model_fingerprint"] or "",
            settings=json.loads(row["settings"] or "{}"), token_count=row["token_count"] or 0,
            message_count=row["message_count"], bytes_on_disk=row["kv_bytes"], kv_tokens=row["kv_tokens"],
            last_used=row["last_used"], kv_dropped=bool(row["kv_dropped"]), origin=row["origin"],
        )

    @_locked
    def search(self, text: str, limit: int = 50) -> builtins.list[SearchHit]:
        """Sessions whose title, messages or attachment names hold every word of `text` (the last word may be
        unfinished), most recently changed first; any text is safe (no query syntax reaches SQLite)."""
        return search_sessions(self.db.conn, text, limit)

    @_locked
    def touch(self, session_id: str) -> None:
        """Mark the session used now (opened), for the disk budget's least-recently-used order."""
        self.db.table("session_usage").upsert({"session_id": session_id, "opened": time.time()}, pk="session_id")

    @_locked
    def update(self, session_id: str, **fields) -> None:
        self.get(session_id)
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"])
        self.db.table("sessions").update(session_id, {**fields, "updated": time.time()})

    def rename(self, session_id: str, title: str) -> None:
        title = title.strip()
        if not title:
            raise ValueError("a session title cannot be empty")
        self.update(session_id, title=title[:200])

    @_locked
    def delete(self, session_id: str) -> None:
        """Remove the session, its messages and every chunk file no other session shares."""
        self.get(session_id)
        files = [r["file"] for r in self.db.query("SELECT file FROM chunks WHERE session_id = ? UNION "
                                                   "SELECT file FROM parked_chunks WHERE session_id = ?",
                                                   [session_id, session_id])]
        with self.db.atomic():
            self.db.execute("DELETE FROM chunks WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM parked_chunks WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM kv_signatures WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM session_usage WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
        self.remove_unreferenced(files)
        folder = self.data_dir / "kv" / session_id
        for leftover in folder.glob(".*.tmp-*") if folder.is_dir() else []:  # a killed writer's temporary file
            leftover.unlink(missing_ok=True)
        if folder.exists() and not any(folder.iterdir()):
            folder.rmdir()
        lock = session_lock(self.data_dir, session_id)
        if lock.try_acquire():  # nobody has it open: its lock file goes too
            lock.path.unlink(missing_ok=True)
            lock.release()

    def _referenced(self, name: str) -> bool:
        return bool(self.db.execute("SELECT 1 FROM chunks WHERE file = ? UNION ALL SELECT 1 FROM parked_chunks "
                                    "WHERE file = ? LIMIT 1", [name, name]).fetchone())

    def remove_unreferenced(self, files: builtins.list[str]) -> None:
        for name in files:
            if not self._referenced(name):
                (self.data_dir / name).unlink(missing_ok=True)

    def remove_leftovers(self, session_id: str) -> builtins.list[str]:
        """Delete what a writer killed mid-snapshot left in the session's folder: temporary files, and
        chunk files that were renamed into place but never registered. Call it holding the session's lock."""
        folder = self.data_dir / "kv" / session_id
        removed = []
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            name = path.relative_to(self.data_dir).as_posix()
            if path.is_file() and not self._referenced(name):
                path.unlink(missing_ok=True)
                removed.append(name)
        return removed

    # ------------------------------------------------------------------ messages
    @_locked
    def messages(self, session_id: str) -> builtins.list[Message]:
        rows = self.db.query("SELECT * FROM messages WHERE session_id = ? ORDER BY position", [session_id])
        return [Message(r["id"], r["role"], r["content"], r["position"], r["token_start"], r["token_end"],
                        r["created"], r["parent_id"], _attachments(r.get("attachments"))) for r in rows]

    def add_message(self, session_id: str, role: str, content: str, token_start: int, token_end: int,
                    attachments: builtins.list[dict] | tuple[dict, ...] = ()) -> int:
        """Append one message; returns its id."""
        return self.add_messages(session_id, [(role, content, token_start, token_end, attachments)])[-1]

    @_locked
    def add_messages(self, session_id: str, messages: builtins.list[tuple]) -> builtins.list[int]:
        """Append (role, content, token_start, token_end[, attachments]) rows in one transaction: all of them or
        none. Returns their ids, in order."""
        previous = self.messages(session_id)
        parent, now, ids = (previous[-1].id if previous else None), time.time(), []
        with self.db.atomic():
            for position, (role, content, start, end, *attached) in enumerate(messages, start=len(previous)):
                parent = self.db.table("messages").insert({
                    "session_id": session_id, "role": role, "content": content, "position": position,
                    "token_start": start, "token_end": end, "created": now, "parent_id": parent,
                    "attachments": json.dumps(list(attached[0]) if attached else []),
                }).last_pk
                ids.append(cast(int, parent))  # a row just inserted has its integer key
            self.db.table("sessions").update(session_id, {"updated": now})
        return ids

    @_locked
    def replace_messages(self, session_id: str, messages: builtins.list[tuple]) -> None:
        """Make (role, content[, attachments]) tuples the session's whole history, in one transaction: a crash
        leaves the old history or the new one, never a mix. Token spans become unknown (-1) until the next turn."""
        now = time.time()
        with self.db.atomic():
            self.db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            parent = None
            for position, (role, content, *attached) in enumerate(messages):
                parent = self.db.table("messages").insert({
                    "session_id": session_id, "role": role, "content": content, "position": position,
                    "token_start": -1, "token_end": -1, "created": now, "parent_id": parent,
                    "attachments": json.dumps(list(attached[0]) if attached else []),
                }).last_pk
            self.db.table("sessions").update(session_id, {"updated": now})

    @_locked
    def update_message(self, message_id: int, content: str, token_end: int) -> None:
        """Set a message's text and where its span ends (a reply stored while it streams)."""
        with self.db.atomic():
            self.db.table("messages").update(message_id, {"content": content, "token_end": token_end})

    @_locked
    def delete_messages_from(self, session_id: str, position: int) -> None:
        with self.db.atomic():
            self.db.execute("DELETE FROM messages WHERE session_id = ? AND position >= ?", [session_id, position])

    # ------------------------------------------------------------------ KV chunks
    @_locked
    def chunks(self, session_id: str) -> builtins.list[ChunkRecord]:
        rows = self.db.query("SELECT * FROM chunks WHERE session_id = ? ORDER BY start", [session_id])
        return [ChunkRecord(r["file"], r["start"], r["end"], r["sha256"], r["size"]) for r in rows]

    @_locked
    def kv_signature(self, session_id: str) -> dict[str, str] | None:
        row = self.db.execute("SELECT signature FROM kv_signatures WHERE session_id = ?", [session_id]).fetchone()
        return json.loads(row[0]) if row else None

    @_locked
    def add_chunk(self, session_id: str, record: ChunkRecord, signature: dict[str, str], token_count: int) -> None:
        """Register a chunk whose file is already durable (the database commit comes last)."""
        with self.db.atomic():
            self.db.execute("UPDATE session_usage SET kv_dropped = 0 WHERE session_id = ?", [session_id])
            self.db.table("kv_signatures").upsert({"session_id": session_id, "signature": json.dumps(signature)},
                                            pk="session_id")
            self.db.table("chunks").insert({"session_id": session_id, **record.__dict__}, replace=True)
            self.db.table("sessions").update(session_id, {"token_count": token_count, "updated": time.time()})

    @_locked
    def replace_chunks(self, session_id: str, records: builtins.list[ChunkRecord], signature: dict[str, str],
                       token_count: int | None = None) -> None:
        """Swap the session's chunks for `records` (durable files) under `signature`, and set its token count
        where given, in one transaction; the old files go unless another session shares them."""
        old = [c.file for c in self.chunks(session_id)]
        with self.db.atomic():
            self.db.execute("DELETE FROM chunks WHERE session_id = ?", [session_id])
            for record in records:
                self.db.table("chunks").insert({"session_id": session_id, **record.__dict__})
            self.db.table("kv_signatures").upsert({"session_id": session_id, "signature": json.dumps(signature)},
                                            pk="session_id")
            if token_count is not None:
                self.db.table("sessions").update(session_id, {"token_count": token_count, "updated": time.time()})
        self.remove_unreferenced([name for name in old if name not in {r.file for r in records}])

    @_locked
    def drop_chunks_from(self, session_id: str, position: int) -> None:
        """Forget chunks that end after `position` (the conversation diverged there)."""
        doomed = [c.file for c in self.chunks(session_id) if c.end > position]
        with self.db.atomic():
            self.db.execute("DELETE FROM chunks WHERE session_id = ? AND end > ?", [session_id, position])
        self.remove_unreferenced(doomed)

    @_locked
    def drop_all_chunks(self, session_id: str) -> None:
        """Forget every chunk of the session, other models' parked ones too (its messages stay), for the disk
        budget, and mark it for the sidebar."""
        self.drop_chunks_from(session_id, -1)
        parked = [r["file"] for r in self.db.query("SELECT file FROM parked_chunks WHERE session_id = ?", [session_id])]
        with self.db.atomic():
            self.db.execute("DELETE FROM parked_chunks WHERE session_id = ?", [session_id])
            self.db.table("session_usage").upsert({"session_id": session_id, "kv_dropped": 1}, pk="session_id")
        self.remove_unreferenced(parked)

    @_locked
    def kv_bytes(self) -> int:
        """Bytes all chunk files take (a file shared by branches counts once)."""
        row = self.db.execute("SELECT COALESCE(SUM(size), 0) FROM (SELECT file, size FROM chunks "
                              "UNION SELECT file, size FROM parked_chunks)").fetchone()
        return row[0]

    @_locked
    def sessions_with_chunks_least_recent_first(self) -> builtins.list[str]:
        rows = self.db.execute(
            "SELECT s.id FROM sessions s LEFT JOIN session_usage u ON u.session_id = s.id "
            "WHERE EXISTS (SELECT 1 FROM chunks c WHERE c.session_id = s.id) "
            "OR EXISTS (SELECT 1 FROM parked_chunks p WHERE p.session_id = s.id) "
            "ORDER BY MAX(s.updated, COALESCE(u.opened, 0)) ASC").fetchall()
        return [row[0] for row in rows]

    # ------------------------------------------------------------------ branch, export, import
    @_locked
    def branch(self, session_id: str, message_id: int) -> str:
        """A new session with the messages up to and including `message_id`, sharing the prefix chunks."""
        source = self.get(session_id)
        messages = self.messages(session_id)
        keep = [m for m in messages if m.position <= next((x.position for x in messages if x.id == message_id), -1)]
        if not keep:
            raise SessionNotFoundError(f"message {message_id} is not in session {session_id}")
        end = keep[-1].token_end
        with self.db.atomic():  # the new session and all it holds, or nothing
            new_id = self.create(f"{source.title} (branch)", source.system_prompt, source.settings,
                                 source.model_fingerprint)
            for m in keep:
                self.db.table("messages").insert({
                    "session_id": new_id, "role": m.role, "content": m.content, "position": m.position,
                    "token_start": m.token_start, "token_end": m.token_end, "created": m.created,
                    "parent_id": None, "attachments": json.dumps(list(m.attachments)),
                })
            self._share_chunks(session_id, new_id, end)
        return new_id

    @_locked
    def share_chunks(self, source_id: str, target_id: str, up_to: int) -> int:
        """Let `target_id` (a session without chunks) use the source's chunks that end by token `up_to`: the
        same files, no copy. Returns the tokens they cover."""
        with self.db.atomic():
            return self._share_chunks(source_id, target_id, up_to)

    def _share_chunks(self, source_id: str, target_id: str, up_to: int) -> int:
        shared = [c for c in self.chunks(source_id) if c.end <= up_to]
        for chunk in shared:
            self.db.table("chunks").insert({"session_id": target_id, **chunk.__dict__})
        signature = self.kv_signature(source_id)
        if signature and shared:
            self.db.table("kv_signatures").insert({"session_id": target_id, "signature": json.dumps(signature)},
                                            replace=True)
        covered = shared[-1].end if shared else 0
        self.db.table("sessions").update(target_id, {"token_count": covered})
        return covered

    def export(self, session_id: str, path: Path | str) -> Path:
        from .archive import export_session

        return export_session(self, session_id, Path(path))

    def import_file(self, path: Path | str, limits: ImportLimits | None = None) -> str:
        from .archive import ImportLimits, import_session
        from .budget import enforce_disk_limit

        session_id = import_session(self, Path(path), limits or ImportLimits())
        enforce_disk_limit(self)
        return session_id


def _attachments(stored: str | None) -> tuple[dict, ...]:
    """A message's attachment records as stored (a JSON list; older rows and damage give none)."""
    try:
        records = json.loads(stored or "[]")
    except ValueError:
        return ()
    return tuple(r for r in records if isinstance(r, dict)) if isinstance(records, list) else ()


# one statement for any number of sessions: the per-session figures are subqueries SQLite answers from indexes
_SUMMARY_SQL = """
SELECT s.*,
  (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id) AS message_count,
  (SELECT COALESCE(SUM(c.size), 0) FROM chunks c WHERE c.session_id = s.id)
    + (SELECT COALESCE(SUM(p.size), 0) FROM parked_chunks p WHERE p.session_id = s.id) AS kv_bytes,
  (SELECT COALESCE(CASE WHEN MIN(c.start) = 0 AND SUM(c."end" - c.start) = MAX(c."end") THEN MAX(c."end") END, 0)
     FROM chunks c WHERE c.session_id = s.id) AS kv_tokens,
  MAX(s.updated, COALESCE(u.opened, 0)) AS last_used,
  COALESCE(u.kv_dropped, 0) AS kv_dropped
FROM sessions s LEFT JOIN session_usage u ON u.session_id = s.id
"""
