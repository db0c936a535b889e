"""Full-text search over every saved chat: titles, messages and the names of attached documents.

    store = SessionStore()                         # builds the index on the first open of an older database
    for hit in store.search("harbour cat"):        # newest session first
        print(hit.title, hit.message_index, hit.snippet)   # snippet: escaped HTML, matches in <mark>...</mark>

The index lives in the session database as two FTS5 tables that SQLite triggers keep in step with
`messages` and `sessions`, so every write path (send, rename, branch, delete, import, dropping the oldest
turns) updates it in the same transaction as the rows themselves, and an older program writing the same
file does too. Messages are indexed with external content: the index holds only the inverted lists, and
`snippet()` reads the text back from the `message_search_source` view. What is indexed of a message is its
question (the text after its attached documents, see `documents.prompt.question_of`) plus the documents'
names: the documents' own text is not, as it would make the index several times the size of the chats.

User text never reaches FTS5 as syntax: it is cut into words, each searched as a quoted term (all must
match), the last one also as a prefix while it is being typed. A lone quote or a trailing AND are then
plain words or nothing, never a syntax error.
"""

from __future__ import annotations

import html
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

MESSAGE_INDEX = "message_search"
TITLE_INDEX = "title_search"
MESSAGE_SOURCE = "message_search_source"
INDEX_TABLES = (MESSAGE_INDEX, TITLE_INDEX)
# the tables FTS5 creates behind each index
_SHADOW_SUFFIXES = ("_data", "_idx", "_docsize", "_config", "_content")
# detail=column: enough for term matches and snippets (we never search phrases), about half the size of full
_FTS_OPTIONS = "tokenize = 'unicode61 remove_diacritics 2', detail = column"
_BUILD_BATCH = 2000  # messages indexed between two progress reports when an older database is indexed
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private-use marks: survive html.escape, then become <mark>
_WORD = re.compile(r"[^\W_]+")  # what FTS5's unicode61 tokenizer keeps as a token: letters and digits
MAX_QUERY_WORDS = 16
SNIPPET_TOKENS = 12

ProgressCallback = Callable[[int, int], None]  # (messages indexed, messages in all)


@dataclass(frozen=True)
class SearchHit:
    session_id: str
    title: str
    snippet: str  # HTML: the text escaped, the matching words in <mark>...</mark>
    message_index: int | None  # position of the matching message in the session; None: only the title matched
    updated: float

    def as_dict(self) -> dict:
        return {"session_id": self.session_id, "title": self.title, "snippet": self.snippet,
                "message_index": self.message_index, "updated": self.updated}


def index_table_names() -> set[str]:
    """Every table the search index adds to the database (the store accepts these as its own)."""
    return {name + suffix for name in INDEX_TABLES for suffix in ("", *_SHADOW_SUFFIXES)}


def _attachment_records(row: str) -> str:
    """SQL: the JSON objects of a message's attachments column (damaged JSON gives none, never an error)."""
    return (f"json_each(CASE WHEN json_valid({row}.attachments) AND json_type({row}.attachments) = 'array' "
            f"THEN {row}.attachments ELSE '[]' END) WHERE type = 'object'")


def _question_sql(row: str) -> str:
    """SQL: the message's text after its documents, as `question_of` cuts it."""
    skipped = (f"(SELECT COALESCE(SUM(CAST(json_extract(value, '$.chars') AS INTEGER)) + 2 * COUNT(*), 0) "
               f"FROM {_attachment_records(row)})")
    return f"substr({row}.content, 1 + {skipped})"


def _names_sql(row: str) -> str:
    return f"(SELECT group_concat(json_extract(value, '$.name'), ' ') FROM {_attachment_records(row)})"


def _schema() -> list[str]:
    new = f"new.id, {_question_sql('new')}, {_names_sql('new')}"
    old = f"'delete', old.id, {_question_sql('old')}, {_names_sql('old')}"
    add = f"INSERT INTO {MESSAGE_INDEX}(rowid, question, names) VALUES ({new});"
    remove = f"INSERT INTO {MESSAGE_INDEX}({MESSAGE_INDEX}, rowid, question, names) VALUES ({old});"
    add_title = f"INSERT INTO {TITLE_INDEX}(title, session_id) VALUES (new.title, new.id);"
    remove_title = f"DELETE FROM {TITLE_INDEX} WHERE session_id = old.id;"
    return [
        f"CREATE VIEW {MESSAGE_SOURCE} AS SELECT m.id AS id, {_question_sql('m')} AS question, "
        f"{_names_sql('m')} AS names FROM messages m",
        f"CREATE VIRTUAL TABLE {MESSAGE_INDEX} USING fts5(question, names, content = '{MESSAGE_SOURCE}', "
        f"content_rowid = 'id', {_FTS_OPTIONS})",
        f"CREATE VIRTUAL TABLE {TITLE_INDEX} USING fts5(title, session_id UNINDEXED, {_FTS_OPTIONS})",
        f"CREATE TRIGGER {MESSAGE_INDEX}_insert AFTER INSERT ON messages BEGIN {add} END",
        f"CREATE TRIGGER {MESSAGE_INDEX}_delete AFTER DELETE ON messages BEGIN {remove} END",
        f"CREATE TRIGGER {MESSAGE_INDEX}_update AFTER UPDATE ON messages BEGIN {remove} {add} END",
        f"CREATE TRIGGER {TITLE_INDEX}_insert AFTER INSERT ON sessions BEGIN {add_title} END",
        f"CREATE TRIGGER {TITLE_INDEX}_delete AFTER DELETE ON sessions BEGIN {remove_title} END",
        f"CREATE TRIGGER {TITLE_INDEX}_update AFTER UPDATE OF title, id ON sessions BEGIN {remove_title} {add_title} END",
    ]


def has_search_index(connection: sqlite3.Connection) -> bool:
    found = connection.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'trigger' AND name = ?",
                               [f"{MESSAGE_INDEX}_insert"]).fetchone()[0]
    return bool(found)


def build_search_index(connection: sqlite3.Connection, progress: ProgressCallback | None = None) -> bool:
    """Give a database saved before the index existed its index (a no-op where it has one): the tables, the
    triggers and the entries for every message and title, in ONE transaction, so a crash midway leaves the
    database as it was and the next open starts again. `progress(done, total)` is called between batches of
    messages (for a status line). Returns whether it built anything."""
    if has_search_index(connection):
        return False
    total = connection.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    connection.execute("BEGIN IMMEDIATE")
    try:
        for statement in _schema():
            connection.execute(statement)
        connection.execute(f"INSERT INTO {TITLE_INDEX}(title, session_id) SELECT title, id FROM sessions")
        done, last_id = 0, -1
        if progress:
            progress(0, total)
        while True:
            ids = [row[0] for row in connection.execute(
                "SELECT id FROM messages WHERE id > ? ORDER BY id LIMIT ?", [last_id, _BUILD_BATCH])]
            if not ids:
                break
            connection.execute(f"INSERT INTO {MESSAGE_INDEX}(rowid, question, names) SELECT id, question, names "
                               f"FROM {MESSAGE_SOURCE} WHERE id BETWEEN ? AND ?", [ids[0], ids[-1]])
            done, last_id = done + len(ids), ids[-1]
            if progress:
                progress(done, total)
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    return True


def fts_query(text: str) -> str | None:
    """The user's text as a safe FTS5 query: its words quoted, all required, the last one also as a prefix
    unless the text ends with a space (the user finished the word). None: no word to search for."""
    words = _WORD.findall(text)[:MAX_QUERY_WORDS]
    if not words:
        return None
    terms = [f'"{word}"' for word in words]
    if not text[-1:].isspace():
        terms[-1] += "*"
    return " ".join(terms)


_HITS_SQL = f"""
WITH hits AS (
  SELECT m.session_id, m.position, ms.rowid AS message_id,
         ROW_NUMBER() OVER (PARTITION BY m.session_id ORDER BY ms.rank, m.position DESC) AS nth
  FROM {MESSAGE_INDEX} ms JOIN messages m ON m.id = ms.rowid
  WHERE {MESSAGE_INDEX} MATCH :query
),
titled AS (SELECT session_id FROM {TITLE_INDEX} WHERE {TITLE_INDEX} MATCH :query)
SELECT s.id, s.title, s.updated, h.position, h.message_id
FROM sessions s LEFT JOIN hits h ON h.session_id = s.id AND h.nth = 1
WHERE h.session_id IS NOT NULL OR s.id IN titled
ORDER BY s.updated DESC
LIMIT :limit
"""


def search_sessions(connection: sqlite3.Connection, text: str, limit: int = 50) -> list[SearchHit]:
    """Sessions matching `text`, most recently changed first, at most `limit`: each with its best-matching
    message (BM25) and a snippet of it, or where only its title matches, the title highlighted."""
    query = fts_query(text)
    if query is None or limit < 1:
        return []
    rows = connection.execute(_HITS_SQL, {"query": query, "limit": limit}).fetchall()
    message_ids = [row[4] for row in rows if row[4] is not None]
    snippets = _message_snippets(connection, query, message_ids)
    titles = _title_highlights(connection, query, [row[0] for row in rows if row[4] is None])
    return [SearchHit(session_id=session_id, title=title, updated=updated, message_index=position,
                      snippet=snippets.get(message_id, "") if message_id is not None else titles.get(session_id, ""))
            for session_id, title, updated, position, message_id in rows]


def _message_snippets(connection: sqlite3.Connection, query: str, message_ids: list[int]) -> dict[int, str]:
    if not message_ids:
        return {}
    marks = ", ".join("?" * len(message_ids))
    rows = connection.execute(
        f"SELECT rowid, snippet({MESSAGE_INDEX}, -1, ?, ?, '…', {SNIPPET_TOKENS}) FROM {MESSAGE_INDEX} "
        f"WHERE {MESSAGE_INDEX} MATCH ? AND rowid IN ({marks})", [_MARK_OPEN, _MARK_CLOSE, query, *message_ids])
    return {rowid: _marked_html(snippet) for rowid, snippet in rows}


def _title_highlights(connection: sqlite3.Connection, query: str, session_ids: list[str]) -> dict[str, str]:
    if not session_ids:
        return {}
    marks = ", ".join("?" * len(session_ids))
    rows = connection.execute(
        f"SELECT session_id, highlight({TITLE_INDEX}, 0, ?, ?) FROM {TITLE_INDEX} "
        f"WHERE {TITLE_INDEX} MATCH ? AND session_id IN ({marks})", [_MARK_OPEN, _MARK_CLOSE, query, *session_ids])
    return {session_id: _marked_html(text) for session_id, text in rows}


def _marked_html(text: str | None) -> str:
    escaped = html.escape(text or "", quote=False)
    return escaped.replace(_MARK_OPEN, "<mark>").replace(_MARK_CLOSE, "</mark>")
