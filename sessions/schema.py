"""The session database's schema and how a file is opened: checked before a byte of it changes, then brought
up to date (tables and columns added since, the full-text index).

    db = open_database(data_dir / "sessions.db", index_progress)   # SessionError for a damaged or foreign file
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlite_utils

from .errors import SessionError
from .search import ProgressCallback, build_search_index, index_table_names


def open_database(path: Path, index_progress: ProgressCallback | None = None) -> sqlite_utils.Database:
    """The database at `path` (created when missing), on one connection any thread may use: the caller
    serialises every use."""
    connection = None
    try:
        connection = sqlite3.connect(path, check_same_thread=False, timeout=30)
        db = sqlite_utils.Database(connection)
        _check_before_writing(db)
        db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer; crash-safe commits
        db.execute("PRAGMA synchronous=FULL")
        _create_tables(db)
        _add_later_columns(db)
        build_search_index(connection, index_progress)  # only a database from before the index needs it
        return db
    except sqlite3.DatabaseError as error:
        if connection is not None:
            connection.close()
        raise SessionError(
            f"the session database {path} is damaged or is not InfiniGen Chat's ({error}); it was left "
            f"as it is: move it aside (rename it) to start with an empty one, or pass another --data-dir"
        ) from None


def _create_tables(db: sqlite_utils.Database) -> None:
    existing = set(db.table_names())
    for name, table in _TABLES.items():
        if name not in existing:
            db.table(name).create(table["columns"], pk=table["pk"], foreign_keys=table.get("foreign_keys"))
            for index in table.get("indexes", ()):
                db.table(name).create_index(index)


def _add_later_columns(db: sqlite_utils.Database) -> None:
    """Give a file written by an older version the columns added since, with their defaults."""
    for (table, column), (kind, default) in _LATER_COLUMNS.items():
        if column not in {c.name for c in db.table(table).columns}:
            db.table(table).add_column(column, kind, not_null_default=default)


def _check_before_writing(db: sqlite_utils.Database) -> None:
    """Refuse a damaged file, or one made by another program, before changing a byte of it."""
    damage = db.execute("PRAGMA quick_check").fetchone()[0]
    if damage != "ok":
        raise sqlite3.DatabaseError(damage)
    tables = set(db.table_names())
    strangers = {t for t in tables if not t.startswith("sqlite_")} - set(_TABLES) - index_table_names()
    if strangers:
        raise sqlite3.DatabaseError(f"it holds other tables ({', '.join(sorted(strangers)[:3])})")
    for table in tables & set(_TABLES):
        missing = set(_TABLES[table]["columns"]) - {column.name for column in db.table(table).columns}
        missing -= {column for (owner, column) in _LATER_COLUMNS if owner == table}
        if missing:
            raise sqlite3.DatabaseError(f"table {table} lacks {', '.join(sorted(missing))}")


ORIGINS = ("app", "api")
_SESSION_KEY = [("session_id", "sessions", "id")]
_TABLES: dict[str, dict[str, Any]] = {  # the one description of the schema: tables are created from it and opened files checked against it
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

_LATER_COLUMNS: dict[tuple[str, str], tuple[type, object]] = {  # (table, column): (type, value for existing rows)
    ("sessions", "origin"): (str, "app"),
    ("messages", "attachments"): (str, "[]"),  # JSON list of attachment records (issue 20)
}
