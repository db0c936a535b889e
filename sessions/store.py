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
they are parked (`park_chunks`), not dropped, keyed by their signature; switching back to that model
brings them back (`unpark_chunks`), so the conversation restores from disk instead of being re-read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import sqlite_utils

from .errors import SessionError, SessionNotFoundError
from .lock import session_lock
from .paths import default_data_dir
from .search import ProgressCallback, SearchHit, build_search_index, index_table_names, search_sessions
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
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        path = self.data_dir / DB_NAME
        connection = None
        try:
            # one connection shared by the app's threads; every use is serialised by _lock
            connection = sqlite3.connect(path, check_same_thread=False, timeout=30)
            self.db = sqlite_utils.Database(connection)
            self._check_before_writing()
            self.db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer; crash-safe commits
            self.db.execute("PRAGMA synchronous=FULL")
            self._create_tables()
            self._add_later_columns()
            build_search_index(connection, index_progress)  # only a database from before the index needs it
        except sqlite3.DatabaseError as error:
            if connection is not None:
                connection.close()
            raise SessionError(
                f"the session database {path} is damaged or is not InfiniGen Chat's ({error}); it was left "
                f"as it is: move it aside (rename it) to start with an empty one, or pass another --data-dir"
            ) from None

    def _create_tables(self) -> None:
        existing = set(self.db.table_names())
        for name, table in _TABLES.items():
            if name not in existing:
                self.db[name].create(table["columns"], pk=table["pk"], foreign_keys=table.get("foreign_keys"))
                for index in table.get("indexes", ()):
                    self.db[name].create_index(index)

    def _add_later_columns(self) -> None:
        """Give a file written by an older version the columns added since, with their defaults."""
        for (table, column), (kind, default) in _LATER_COLUMNS.items():
            if column not in {c.name for c in self.db[table].columns}:
                self.db[table].add_column(column, kind, not_null_default=default)

    def _check_before_writing(self) -> None:
        """Refuse a damaged file, or one made by another program, before changing a byte of it."""
        damage = self.db.execute("PRAGMA quick_check").fetchone()[0]
        if damage != "ok":
            raise sqlite3.DatabaseError(damage)
        tables = set(self.db.table_names())
        strangers = {t for t in tables if not t.startswith("sqlite_")} - set(_TABLES) - index_table_names()
        if strangers:
            raise sqlite3.DatabaseError(f"it holds other tables ({', '.join(sorted(strangers)[:3])})")
        for table in tables & set(_TABLES):
            missing = set(_TABLES[table]["columns"]) - {column.name for column in self.db[table].columns}
            missing -= {column for (owner, column) in _LATER_COLUMNS if owner == table}
            if missing:
                raise sqlite3.DatabaseError(f"table {table} lacks {', '.join(sorted(missing))}")

    # ------------------------------------------------------------------ sessions
    @_locked
    def create(self, title: str = "New chat", system_prompt: str = "", settings: dict | None = None,
               fingerprint: str = "", origin: str = "app") -> str:
        if origin not in ORIGINS:
            raise ValueError(f"a session's origin is one of {', '.join(ORIGINS)}, got {origin!r}")
        session_id = uuid.uuid4().hex[:16]
        now = time.time()
        self.db["sessions"].insert({
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
    def list(self) -> list[SessionSummary]:
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
    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Sessions whose title, messages or attachment names hold every word of `text` (the last word may be
        unfinished), most recently changed first; any text is safe (no query syntax reaches SQLite)."""
        return search_sessions(self.db.conn, text, limit)

    @_locked
    def touch(self, session_id: str) -> None:
        """Mark the session used now (opened), for the disk budget's least-recently-used order."""
        self.db["session_usage"].upsert({"session_id": session_id, "opened": time.time()}, pk="session_id")

    @_locked
    def update(self, session_id: str, **fields) -> None:
        self.get(session_id)
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"])
        self.db["sessions"].update(session_id, {**fields, "updated": time.time()})

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

    def remove_unreferenced(self, files: list[str]) -> None:
        for name in files:
            if not self._referenced(name):
                (self.data_dir / name).unlink(missing_ok=True)

    def remove_leftovers(self, session_id: str) -> list[str]:
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
    def messages(self, session_id: str) -> list[Message]:
        rows = self.db.query("SELECT * FROM messages WHERE session_id = ? ORDER BY position", [session_id])
        return [Message(r["id"], r["role"], r["content"], r["position"], r["token_start"], r["token_end"],
                        r["created"], r["parent_id"], _attachments(r.get("attachments"))) for r in rows]

    def add_message(self, session_id: str, role: str, content: str, token_start: int, token_end: int,
                    attachments: list[dict] | tuple[dict, ...] = ()) -> None:
        self.add_messages(session_id, [(role, content, token_start, token_end, attachments)])

    @_locked
    def add_messages(self, session_id: str, messages: list[tuple]) -> None:
        """Append (role, content, token_start, token_end[, attachments]) rows in one transaction: all of them or
        none."""
        previous = self.messages(session_id)
        parent, now = (previous[-1].id if previous else None), time.time()
        with self.db.atomic():
            for position, (role, content, start, end, *attached) in enumerate(messages, start=len(previous)):
                parent = self.db["messages"].insert({
                    "session_id": session_id, "role": role, "content": content, "position": position,
                    "token_start": start, "token_end": end, "created": now, "parent_id": parent,
                    "attachments": json.dumps(list(attached[0]) if attached else []),
                }).last_pk
            self.db["sessions"].update(session_id, {"updated": now})

    @_locked
    def replace_messages(self, session_id: str, messages: list[tuple]) -> None:
        """Make (role, content[, attachments]) tuples the session's whole history, in one transaction: a crash
        leaves the old history or the new one, never a mix. Token spans become unknown (-1) until the next turn."""
        now = time.time()
        with self.db.atomic():
            self.db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            parent = None
            for position, (role, content, *attached) in enumerate(messages):
                parent = self.db["messages"].insert({
                    "session_id": session_id, "role": role, "content": content, "position": position,
                    "token_start": -1, "token_end": -1, "created": now, "parent_id": parent,
                    "attachments": json.dumps(list(attached[0]) if attached else []),
                }).last_pk
            self.db["sessions"].update(session_id, {"updated": now})

    @_locked
    def update_message(self, message_id: int, content: str, token_end: int) -> None:
        """Set a message's text and where its span ends (a reply stored while it streams)."""
        with self.db.atomic():
            self.db["messages"].update(message_id, {"content": content, "token_end": token_end})

    @_locked
    def delete_messages_from(self, session_id: str, position: int) -> None:
        with self.db.atomic():
            self.db.execute("DELETE FROM messages WHERE session_id = ? AND position >= ?", [session_id, position])

    # ------------------------------------------------------------------ KV chunks
    @_locked
    def chunks(self, session_id: str) -> list[ChunkRecord]:
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
            self.db["kv_signatures"].upsert({"session_id": session_id, "signature": json.dumps(signature)},
                                            pk="session_id")
            self.db["chunks"].insert({"session_id": session_id, **record.__dict__}, replace=True)
            self.db["sessions"].update(session_id, {"token_count": token_count, "updated": time.time()})

    @_locked
    def replace_chunks(self, session_id: str, records: list[ChunkRecord], signature: dict[str, str]) -> None:
        """Swap the session's chunks for `records` (durable files) under `signature`, in one transaction;
        the old files go unless another session shares them."""
        old = [c.file for c in self.chunks(session_id)]
        with self.db.atomic():
            self.db.execute("DELETE FROM chunks WHERE session_id = ?", [session_id])
            for record in records:
                self.db["chunks"].insert({"session_id": session_id, **record.__dict__})
            self.db["kv_signatures"].upsert({"session_id": session_id, "signature": json.dumps(signature)},
                                            pk="session_id")
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
            self.db["session_usage"].upsert({"session_id": session_id, "kv_dropped": 1}, pk="session_id")
        self.remove_unreferenced(parked)

    @_locked
    def kv_bytes(self) -> int:
        """Bytes all chunk files take (a file shared by branches counts once)."""
        row = self.db.execute("SELECT COALESCE(SUM(size), 0) FROM (SELECT file, size FROM chunks "
                              "UNION SELECT file, size FROM parked_chunks)").fetchone()
        return row[0]

    @_locked
    def sessions_with_chunks_least_recent_first(self) -> list[str]:
        rows = self.db.execute(
            "SELECT s.id FROM sessions s LEFT JOIN session_usage u ON u.session_id = s.id "
            "WHERE EXISTS (SELECT 1 FROM chunks c WHERE c.session_id = s.id) "
            "OR EXISTS (SELECT 1 FROM parked_chunks p WHERE p.session_id = s.id) "
            "ORDER BY MAX(s.updated, COALESCE(u.opened, 0)) ASC").fetchall()
        return [row[0] for row in rows]

    @_locked
    def park_chunks(self, session_id: str) -> int:
        """Set the session's chunks aside under their model's signature (replacing an older set of the same
        signature); the session is left with none. Returns how many were parked."""
        signature, chunks = self.kv_signature(session_id), self.chunks(session_id)
        if signature is None or not chunks:
            return 0
        key = signature_key(signature)
        replaced = [r["file"] for r in self.db.query(
            "SELECT file FROM parked_chunks WHERE session_id = ? AND signature_key = ?", [session_id, key])]
        with self.db.atomic():
            self.db.execute("DELETE FROM parked_chunks WHERE session_id = ? AND signature_key = ?", [session_id, key])
            for chunk in chunks:
                self.db["parked_chunks"].insert({"session_id": session_id, "signature_key": key,
                                                 "signature": json.dumps(signature), **chunk.__dict__})
            self.db.execute("DELETE FROM chunks WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM kv_signatures WHERE session_id = ?", [session_id])
        self.remove_unreferenced(replaced)
        return len(chunks)

    @_locked
    def unpark_chunks(self, session_id: str, signature: dict[str, str]) -> int:
        """Bring back the chunks parked under `signature` as the session's chunks (it must have none).
        Returns how many came back (0: none were parked for that model)."""
        key = signature_key(signature)
        rows = list(self.db.query("SELECT * FROM parked_chunks WHERE session_id = ? AND signature_key = ? "
                                  "ORDER BY start", [session_id, key]))
        if not rows or self.chunks(session_id):
            return 0
        with self.db.atomic():
            for row in rows:
                self.db["chunks"].insert({k: row[k] for k in ("session_id", "start", "end", "file", "sha256", "size")})
            self.db["kv_signatures"].upsert({"session_id": session_id, "signature": json.dumps(signature)},
                                            pk="session_id")
            self.db.execute("DELETE FROM parked_chunks WHERE session_id = ? AND signature_key = ?", [session_id, key])
        return len(rows)

    @_locked
    def parked_models(self, session_id: str) -> list[str]:
        """Model fingerprints whose KV chunks this session keeps parked."""
        rows = self.db.query("SELECT DISTINCT signature FROM parked_chunks WHERE session_id = ?", [session_id])
        return sorted(json.loads(r["signature"]).get("model_fingerprint", "?") for r in rows)

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
                self.db["messages"].insert({
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
            self.db["chunks"].insert({"session_id": target_id, **chunk.__dict__})
        signature = self.kv_signature(source_id)
        if signature and shared:
            self.db["kv_signatures"].insert({"session_id": target_id, "signature": json.dumps(signature)},
                                            replace=True)
        covered = shared[-1].end if shared else 0
        self.db["sessions"].update(target_id, {"token_count": covered})
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


ORIGINS = ("app", "api")
_SESSION_KEY = [("session_id", "sessions", "id")]
_TABLES = {  # the one description of the schema: tables are created from it and opened files checked against it
    "sessions": {"columns": {"id": str, "title": str, "system_prompt": str, "created": float, "updated": float,
                             "model_fingerprint": str, "settings": str, "token_count": int, "origin": str},
                 "pk": "id"},
    "messages": {"columns": {"id": int, "session_id": str, "role": str, "content": str, "position": int,
                             "token_start": int, "token_end": int, "created": float, "parent_id": int,
                             "attachments": str},
                 "pk": "id", "foreign_keys": _SESSION_KEY, "indexes": [["session_id", "position"]]},
    "chunks": {"columns": {"session_id": str, "start": int, "end": int, "file": str, "sha256": str, "size": int},
               "pk": ("session_id", "start"), "foreign_keys": _SESSION_KEY},
    "kv_signatures": {"columns": {"session_id": str, "signature": str}, "pk": "session_id"},
    # chunks written under another model than the session's current one (see park_chunks)
    "parked_chunks": {"columns": {"session_id": str, "signature_key": str, "signature": str, "start": int, "end": int,
                                  "file": str, "sha256": str, "size": int},
                      "pk": ("session_id", "signature_key", "start"), "foreign_keys": _SESSION_KEY},
    # added later: a database made before it simply gets the table (no existing table changes)
    "session_usage": {"columns": {"session_id": str, "opened": float, "kv_dropped": int}, "pk": "session_id"},
}

_LATER_COLUMNS = {  # (table, column): (type, value for existing rows)
    ("sessions", "origin"): (str, "app"),
    ("messages", "attachments"): (str, "[]"),  # JSON list of attachment records (issue 20)
}


def _attachments(stored: str | None) -> tuple[dict, ...]:
    """A message's attachment records as stored (a JSON list; older rows and damage give none)."""
    try:
        records = json.loads(stored or "[]")
    except ValueError:
        return ()
    return tuple(r for r in records if isinstance(r, dict)) if isinstance(records, list) else ()


def signature_key(signature: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


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
