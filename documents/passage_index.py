"""A full-text (FTS5, BM25) index of one document's passages, in a SQLite file named by the file's SHA-256.

    index = PassageIndex.open(data_dir / "passages", document, passage_tokens=200, data=pdf_bytes)
    index.best("What is the harbour master's cat named?", count=8)   # passage numbers, best first
    index.passages()[0].location                                      # 'page 1'

The same file attached in another chat (same SHA-256) finds its index already built and reads nothing
again. A file is built under a temporary name and renamed into place, so a crash leaves no half index; a
damaged or foreign file in its place is rebuilt.
"""

from __future__ import annotations

import os
import re
import sqlite3
import tempfile
from pathlib import Path

from documents.document import Document
from documents.page_starts import page_starts
from documents.passages import Passage, split_passages

# questions are matched on word stems ("named" finds "name"), accents and case ignored
_TOKENIZER = "porter unicode61 remove_diacritics 2"
_WORD = re.compile(r"[^\W_]+")
_FORMAT = "infinigen-passages/1"
MAX_QUESTION_WORDS = 64


class PassageIndex:
    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._connection, self.path = connection, path

    @classmethod
    def open(cls, folder: Path | str, document: Document, passage_tokens: int = 200,
             data: bytes | None = None) -> PassageIndex:
        """The document's index, built on first use. `data`: the original file's bytes, for a PDF's or DOCX's
        page numbers."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{document.sha256}-{passage_tokens}.sqlite"
        if path.exists():
            connection = _opened_if_valid(path, document, passage_tokens)
            if connection is not None:
                return cls(connection, path)
        starts = page_starts(document, data)
        _build(path, document, split_passages(document, passage_tokens, starts), passage_tokens)
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
