"""Full-text search over saved chats: kept by the store itself, on every write path, safe for any text."""

import sqlite3

import pytest

from documents import Document, attachment_record, message_with_attachments
from sessions import SessionStore
from sessions.search import drop_search_index, has_search_index, index_table_names
from sessions.search_terms import SearchTerms

WORDS = ("river", "mountain", "budget", "recipe", "garden", "invoice", "python", "guitar", "lantern", "meadow")


def filler(n: int) -> str:
    return " ".join(WORDS[(n * 7 + k) % len(WORDS)] for k in range(12))


@pytest.fixture
def store(tmp_path):
    return SessionStore(tmp_path / "data")


def add_chats(store, count: int, messages: int = 4) -> list[str]:
    ids = []
    for n in range(count):
        session_id = store.create(f"Chat {n}")
        store.add_messages(session_id, [("user" if k % 2 == 0 else "assistant", filler(n + k), 0, 0)
                                        for k in range(messages)])
        ids.append(session_id)
    return ids


def test_a_word_from_one_message_among_300_sessions_finds_that_session_and_message(store):
    ids = add_chats(store, 300)
    target = ids[137]
    store.add_message(target, "user", "Where did I leave the <b>zeppelin</b> tickets?", 0, 0)
    hits = store.search("zeppelin")
    assert [h.session_id for h in hits] == [target]
    assert hits[0].message_index == 4 and hits[0].title == "Chat 137"
    # the message's own markup is escaped; only the match is marked
    assert hits[0].snippet == "Where did I leave the &lt;b&gt;<mark>zeppelin</mark>&lt;/b&gt; tickets?"
    assert hits[0].as_dict().keys() == {"session_id", "title", "snippet", "message_index", "updated"}
    assert store.search("zeppel")[0].session_id == target  # the word being typed matches as a prefix
    assert store.search("zeppel ") == []  # ...and as a whole word once a space ends it
    assert store.search("ZEPPELIN tickets")[0].session_id == target  # every word, any case
    assert store.search("zeppelin tickets guitar") == []  # all words must be in one message


def test_results_come_newest_first_with_the_newest_matching_message_of_each_session(store):
    older, newer = store.create("older"), store.create("newer")
    store.add_messages(older, [("user", "a walk by the river", 0, 0)])
    store.add_messages(newer, [("user", "river", 0, 0), ("assistant", "the river river river", 0, 0)])
    store.add_messages(older, [("user", "nothing to see", 0, 0)])  # changed last: now the newest
    hits = store.search("river")
    assert [h.session_id for h in hits] == [older, newer]
    assert hits[1].message_index == 1 and hits[1].snippet.count("<mark>river</mark>") == 3
    assert len(store.search("river", limit=1)) == 1


def test_rename_delete_branch_and_dropping_turns_are_reflected_at_once(store):
    session_id = store.create("Trip planning")
    store.add_messages(session_id, [("user", "Which ferry goes to Orkney?", 0, 0),
                                    ("assistant", "The one from Scrabster.", 0, 0),
                                    ("user", "And the bus to Thurso?", 0, 0)])
    assert store.search("planning")[0].message_index is None  # only the title matched
    store.rename(session_id, "Scottish islands")
    assert store.search("planning") == []
    assert store.search("scottish")[0].snippet == "<mark>Scottish</mark> islands"

    first = store.messages(session_id)[0]
    branch = store.branch(session_id, first.id)
    assert {h.session_id for h in store.search("orkney")} == {session_id, branch}
    assert store.search("thurso")[0].session_id == session_id  # the branch stopped before it

    # dropping the oldest turns rewrites the history in one transaction (ChatSession.drop_oldest_turns)
    kept = store.messages(session_id)[2:]
    store.replace_messages(session_id, [(m.role, m.content, m.attachments) for m in kept])
    assert [h.session_id for h in store.search("orkney")] == [branch]
    assert store.search("thurso")[0].message_index == 0

    store.delete(session_id)
    assert store.search("thurso") == [] and store.search("scottish")[0].session_id == branch
    store.delete(branch)
    assert store.search("orkney") == [] and store.search("islands") == []


def test_attached_documents_are_found_by_name_and_the_question_but_not_by_their_text(store):
    document = Document(name="harbour-report.pdf", kind="pdf", text="The quartermaster counted barrels.",
                        sha256="a" * 64, size_bytes=100, pages=1)
    session_id = store.create("Reports")
    store.add_message(session_id, "user", message_with_attachments("Who counted?", [document]), 0, 0,
                      [attachment_record(document)])
    assert store.search("harbour report")[0].session_id == session_id
    assert store.search("counted")[0].snippet == "Who <mark>counted</mark>?"
    assert store.search("quartermaster") == []  # the document's text is not indexed, only its name
    assert store.search("kind pages") == []  # nor the tags around it


HOSTILE = {  # text: whether the message below must be found
    '"': False, "'": False, "cat AND": True, "AND": True, "OR NOT": False, "(": False, "NEAR(cat": True, "*": False,
    "cat*": True, "^cat": True, "col:cat": False, '"cat" "dog': True, "-": False, "{a b}": False, "\x00": False,
    "😀": False, "": False, "   ": False, "a" * 5000: False, " ".join(["cat"] * 200): True, "garden)": True,
}


@pytest.mark.parametrize("text", list(HOSTILE), ids=range(len(HOSTILE)))
def test_any_text_is_searched_as_plain_words_never_as_an_error(store, text):
    session_id = store.create("Pets")
    store.add_messages(session_id, [("user", "My cat and my dog OR a rabbit; near the (garden)", 0, 0)])
    assert [h.session_id for h in store.search(text)] == ([session_id] if HOSTILE[text] else [])


def test_the_query_quotes_every_word_and_the_snippet_marks_what_matched():
    assert SearchTerms.parse('cat "AND').fts_query() == '"cat" "AND"*'
    assert SearchTerms.parse("naïve café ").fts_query() == '"naïve" "café"'
    assert SearchTerms.parse("cat a").fts_query() == '"cat" "a"'  # one letter: not a prefix of every a-word
    assert SearchTerms.parse('" * ( )').fts_query() is None
    terms = SearchTerms.parse("CAFE nai")
    assert terms.highlight("Le café naïf, <i>naive</i>") == "Le <mark>café</mark> <mark>naïf</mark>, &lt;i&gt;<mark>naive</mark>&lt;/i&gt;"
    long = " ".join(f"w{n}" for n in range(100)).replace("w50", "the Café")
    assert SearchTerms.parse("cafe ").snippet(long) == "…w47 w48 w49 the <mark>Café</mark> w51 w52 w53 w54 w55 w56 w57 w58 w59…"
    assert SearchTerms.parse("w1 ").snippet("w1\n\n  w2") == "<mark>w1</mark> w2"


def test_a_database_from_before_the_index_is_indexed_on_first_open_with_progress(tmp_path):
    data = tmp_path / "data"
    store = SessionStore(data)
    ids = add_chats(store, 30, messages=150)
    store.add_message(ids[5], "user", "the lighthouse keeper", 0, 0)
    drop_search_index(store.db.conn)  # the file as an earlier version left it
    store.db.conn.close()

    reports = []
    reopened = SessionStore(data, index_progress=lambda done, total: reports.append((done, total)))
    assert reports[0] == (0, 4501) and reports[-1] == (4501, 4501) and len(reports) > 2
    assert [h.session_id for h in reopened.search("lighthouse")] == [ids[5]]
    assert reopened.search("chat 7")[0].session_id == ids[7]
    reports.clear()
    reopened.db.conn.close()
    SessionStore(data, index_progress=lambda done, total: reports.append((done, total)))
    assert reports == []  # built once


def test_an_interrupted_index_build_leaves_the_database_as_it_was(tmp_path):
    data = tmp_path / "data"
    store = SessionStore(data)
    add_chats(store, 10, messages=500)
    drop_search_index(store.db.conn)
    store.db.conn.close()

    def interrupt(done, total):
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        SessionStore(data, index_progress=interrupt)
    with sqlite3.connect(data / "sessions.db") as connection:
        assert not has_search_index(connection)
        assert not index_table_names() & {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
    assert SessionStore(data).search("river")  # the next open builds it in full


def test_an_import_and_a_write_by_another_program_are_indexed(store, tmp_path):
    session_id = store.create("Saved elsewhere")
    store.add_messages(session_id, [("user", "about the observatory", 0, 0)])
    path = store.export(session_id, tmp_path / "chat.igchat")
    imported = store.import_file(path)
    assert {h.session_id for h in store.search("observatory")} == {session_id, imported}
    # an older version of the app writes the same file with plain SQL: the triggers still keep the index
    store.db.execute("INSERT INTO messages (session_id, role, content, position, token_start, token_end, created, "
                     "attachments) VALUES (?, 'user', 'a telescope', 1, 0, 0, 0, 'not json')", [session_id])
    assert store.search("telescope")[0].session_id == session_id
