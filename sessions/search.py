"""Full-text search over every saved chat: titles, messages and the names of attached documents.

    store = SessionStore()                         # builds the index on the first open of an older database
    for hit in store.search("harbour cat"):        # newest session first
        print(hit.title, hit.message_index, hit.snippet)   # snippet: escaped HTML, matches in <mark>...</mark>

The index lives in the session database as two FTS5 tables that SQLite triggers keep in step with
`messages` and `sessions`, so every write path (send, rename, branch, delete, import, dropping the oldest
turns) updates it in the same transaction as the rows themselves, and an older program writing the same
file does too. Messages are indexed with external content: the index holds only the inverted lists, and the
text is read back from the `message_search_source` view for the snippets of the hits shown. What is indexed of a message is its
question (the text after its attached documents, see `documents.prompt.question_of`) plus the documents'
names: the documents' own text is not, as it would make the index several times the size of the chats.

User text never reaches FTS5 as syntax: it is cut into words, each searched as a quoted term (all must
match), the last one also as a prefix while it is being typed. A lone quote or a trailing AND are then
plain words or nothing, never a syntax error.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from .search_terms import SearchTerms

MESSAGE_INDEX = "message_search"
TITLE_INDEX = "title_search"
MESSAGE_SOURCE = "message_search_source"
INDEX_TABLES = (MESSAGE_INDEX, TITLE_INDEX)
# the tables FTS5 creates behind each index
_SHADOW_SUFFIXES = ("_data", "_idx", "_docsize", "_config", "_content")
# detail=none and columnsize=0: the index records which messages hold a word, not where or how often (we
# search words, not phrases, and do not rank): 40% of the size with positions. The snippets are made from the
# few messages shown (search_terms.py). prefix='2 3': the first two and three letters of every word have
# lists of their own, so a word being typed costs as little as a whole one (measured: 3 ms, not 90 ms)
_FTS_OPTIONS = "tokenize = 'unicode61 remove_diacritics 2', detail = none, columnsize = 0, prefix = '2 3'"
_BUILD_BATCH = 2000  # messages indexed between two progress reports when an older database is indexed

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
        (f"CREATE VIEW {MESSAGE_SOURCE} AS SELECT m.id AS id, {_question_sql('m')} AS question, "
         f"{_names_sql('m')} AS names FROM messages m"),
        (f"CREATE VIRTUAL TABLE {MESSAGE_INDEX} USING fts5(question, names, content = '{MESSAGE_SOURCE}', "
         f"content_rowid = 'id', {_FTS_OPTIONS})"),
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


def drop_search_index(connection: sqlite3.Connection) -> None:
    """Remove the index, its triggers and its view: the file as a version before the index left it (the next
    `SessionStore` open builds it again). For tests of old databases, and to rebuild an index from scratch."""
    with connection:
        for name, kind in connection.execute(
                "SELECT name, type FROM sqlite_master WHERE type IN ('trigger', 'view') AND name IN "
                "(SELECT value FROM json_each(?))", [json.dumps([MESSAGE_SOURCE, *_trigger_names()])]).fetchall():
            connection.execute(f"DROP {kind.upper()} {name}")
        for table in INDEX_TABLES:
            connection.execute(f"DROP TABLE IF EXISTS {table}")


def _trigger_names() -> list[str]:
    return [f"{index}_{event}" for index in INDEX_TABLES for event in ("insert", "delete", "update")]


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


# A word found in more messages than this (limit x 40) is looked up among its newest matches only: SQLite
# then reads a bounded part of the index, and the sessions come from the most recent uses of the word.
CANDIDATES_PER_RESULT = 40


def search_sessions(connection: sqlite3.Connection, text: str, limit: int = 50) -> list[SearchHit]:
    """Sessions matching `text`, most recently changed first, at most `limit`: each with its newest matching
    message and a snippet of it, or where only its title matches, the title highlighted.

    Sessions are found from the newest `limit x CANDIDATES_PER_RESULT` matching messages (all of them for any
    but the most common words) and every matching title."""
    terms = SearchTerms.parse(text)
    query = terms.fts_query()
    if query is None or limit < 1:
        return []
    newest_match: dict[str, tuple[int, int]] = {}  # session -> (message id, position) of its newest match
    for message_id, session_id, position in connection.execute(
            f"SELECT m.id, m.session_id, m.position FROM (SELECT rowid FROM {MESSAGE_INDEX} WHERE {MESSAGE_INDEX} "
            f"MATCH ? ORDER BY rowid DESC LIMIT ?) hit JOIN messages m ON m.id = hit.rowid",
            [query, limit * CANDIDATES_PER_RESULT]):
        newest_match.setdefault(session_id, (message_id, position))  # ids grow with time: the first is the newest
    titled = [row[0] for row in connection.execute(
        f"SELECT session_id FROM {TITLE_INDEX} WHERE {TITLE_INDEX} MATCH ?", [query])]
    sessions = connection.execute(
        "SELECT id, title, updated FROM sessions WHERE id IN (SELECT value FROM json_each(?)) "
        "ORDER BY updated DESC LIMIT ?", [json.dumps(sorted({*newest_match, *titled})), limit]).fetchall()
    chosen = [newest_match[s][0] for s, _, _ in sessions if s in newest_match]
    snippets = _message_snippets(connection, terms, chosen)
    hits = []
    for session_id, title, updated in sessions:
        message_id, position = newest_match.get(session_id, (None, None))
        snippet = snippets.get(message_id, "") if message_id is not None else terms.highlight(title)
        hits.append(SearchHit(session_id, title, snippet, position, updated))
    return hits


def _message_snippets(connection: sqlite3.Connection, terms: SearchTerms, message_ids: list[int]) -> dict[int, str]:
    """A snippet of each message: its question where a word matched there, else its attachments' names."""
    if not message_ids:
        return {}
    rows = connection.execute(f"SELECT id, question, names FROM {MESSAGE_SOURCE} WHERE id IN "
                              f"(SELECT value FROM json_each(?))", [json.dumps(message_ids)])
    snippets = {}
    for message_id, question, names in rows:
        shown = question if not names or terms.first_match(question or "") is not None else names
        snippets[message_id] = terms.snippet(shown or "")
    return snippets
