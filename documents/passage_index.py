"""A full-text (FTS5, BM25) index of one document's passages, in a SQLite file named by the file's SHA-256.

    index = PassageIndex.open(data_dir / "passages", document, passage_tokens=200)
    index.best("What is the harbour master's cat named?", count=8)   # passage numbers, best first
    index.passages()[0].location                                      # 'page 1'

The same file attached in another chat (same SHA-256) finds its index already built and reads nothing
again. A file is built under a temporary name and renamed into place, so a crash leaves no half index; a
damaged or foreign file in its place is rebuilt. The folder is bounded: once its indexes pass
`FOLDER_LIMIT_BYTES`, those used longest ago are removed (a later question about that file builds its index
again, from the text the stored message or the new attachment has).
"""

from __future__ import annotations

import os
import re
import sqlite3
import tempfile
from pathlib import Path

from documents.document import Document
from documents.passages import Passage, split_passages

# questions are matched on word stems ("named" finds "name"), accents and case ignored
_TOKENIZER = "porter unicode61 remove_diacritics 2"
_WORD = re.compile(r"[^\W_]+")
_FORMAT = "infinigen-passages/1"
MAX_QUESTION_WORDS = 64
# an index takes about twice its document's text (the passages and the FTS5 tables); 2,000,000 characters of
# text, the most a file may give, makes about 4 MiB, so the folder keeps some 60 of the largest files
FOLDER_LIMIT_BYTES = 256 * 2**20


class PassageIndex:
    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._connection, self.path = connection, path

    @classmethod
    def open(cls, folder: Path | str, document: Document, passage_tokens: int = 200,
             folder_limit_bytes: int = FOLDER_LIMIT_BYTES) -> PassageIndex:
        """The document's index, built on first use (its passages name pages where the converter found them:
        `document.page_starts`)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{document.sha256}-{passage_tokens}.sqlite"
        if path.exists():
            connection = _opened_if_valid(path, document, passage_tokens)
            if connection is not None:
                os.utime(path)  # used now: the folder's bound removes the indexes used longest ago
                return cls(connection, path)
        _build(path, document, split_passages(document, passage_tokens, document.page_starts), passage_tokens)
        prune_folder(folder, folder_limit_bytes, keep=path)
        return cls(sqlite3.connect(path, check_same_thread=False), path)

    def passages(self) -> list[Passage]:
        rows = self._connection.execute("SELECT idx, text, first_line, last_line, page FROM passages ORDER BY idx")
        return [Passage(*row) for row in rows]

    def best(self, question: str, count: int) -> list[int]:
        """Up to `count` passage numbers, best BM25 score for the question's words first (any word may match)."""
        words = _WORD.findall(question)[:MAX_QUESTION_WORDS]
        if not words or count < 1:
            return []
        query = " OR ".join(f'"{word}"' for word in dict.fromkeys(w.lower() for w in words))
        rows = self._connection.execute("SELECT rowid FROM passage_search WHERE passage_search MATCH ? "
                                        "ORDER BY rank LIMIT ?", [query, count])
        return [row[0] for row in rows]

    def close(self) -> None:
        self._connection.close()


def prune_folder(folder: Path, limit_bytes: int, keep: Path) -> list[Path]:
    """Remove the indexes used longest ago until the folder's indexes take at most `limit_bytes` (never `keep`,
    the one just built, nor a temporary file being built); returns those removed. An index open elsewhere
    stays readable through its open handle until that closes."""
    indexes = []
    for path in folder.glob("*.sqlite"):
        try:
            indexes.append((path.stat().st_mtime_ns, path.stat().st_size, path))
        except FileNotFoundError:  # removed by another process meanwhile
            continue
    total, removed = sum(size for _, size, _ in indexes), []
    for _, size, path in sorted(indexes):
        if total <= limit_bytes:
            break
        if path != keep:
            path.unlink(missing_ok=True)
            total -= size
            removed.append(path)
    return removed


def _opened_if_valid(path: Path, document: Document, passage_tokens: int) -> sqlite3.Connection | None:
    connection = sqlite3.connect(path, check_same_thread=False)
    try:
        meta = dict(connection.execute("SELECT key, value FROM meta").fetchall())
        if meta == {"format": _FORMAT, "sha256": document.sha256, "passage_tokens": str(passage_tokens)}:
            return connection
    except sqlite3.DatabaseError:
        pass
    connection.close()
    return None


def _build(path: Path, document: Document, passages: list[Passage], passage_tokens: int) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        with sqlite3.connect(temporary) as connection:
            connection.executescript(f"""
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
                CREATE TABLE passages (idx INTEGER PRIMARY KEY, text TEXT, first_line INTEGER, last_line INTEGER,
                                       page INTEGER);
                CREATE VIRTUAL TABLE passage_search USING fts5(text, content = 'passages', content_rowid = 'idx',
                                                               tokenize = '{_TOKENIZER}');
            """)
            connection.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("format", _FORMAT), ("sha256", document.sha256), ("passage_tokens", str(passage_tokens))])
            connection.executemany("INSERT INTO passages VALUES (?, ?, ?, ?, ?)", [
                (p.index, p.text, p.first_line, p.last_line, p.page) for p in passages])
            connection.execute("INSERT INTO passage_search(passage_search) VALUES ('rebuild')")
        connection.close()
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
