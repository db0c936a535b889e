"""Attached documents in sessions: stored with the message, carried by export/import, read once for any chat."""

import base64
import json
import zipfile

import pytest

from documents import attachment_card, convert_bytes, displayed_message, message_with_attachments, question_of
from infinigen_core.config import SamplingConfig
from sessions import ChatSession, SessionStore
from sessions.search import drop_search_index

SHORT = SamplingConfig(max_new_tokens=4)
# about 500 tokens of plain text, the same bytes every time
DOCUMENT_BYTES = ("\n".join(f"Line {i}: the harbour master logged ship {i * 7 % 97} arriving with "
                            f"{i * 13 % 50} crates of tea and {i % 9} passengers." for i in range(24))).encode()


@pytest.fixture
def store(tmp_path):
    return SessionStore(tmp_path / "data")


def document():
    return convert_bytes("harbour log.txt", DOCUMENT_BYTES)


def test_a_message_keeps_its_attachments_metadata_and_shows_them_as_cards(store, real_engine):
    session_id = store.create("doc")
    with ChatSession.open(store, real_engine, session_id) as chat:
        list(chat.send("How many ships?", SHORT, attachments=[document()]))
    user = SessionStore(store.data_dir).messages(session_id)[0]  # as a reopened store reads it
    (record,) = user.attachments
    assert record["name"] == "harbour log.txt" and record["kind"] == "text" and record["lines"] == 24
    assert record["sha256"] == document().sha256 and record["size_bytes"] == len(DOCUMENT_BYTES)
    assert 300 < record["tokens"] < 1000
    assert user.content.startswith('<document name="harbour log.txt"') and "ship 7 arriving" in user.content
    assert question_of(user.content, user.attachments) == "How many ships?"
    shown = displayed_message(user.content, user.attachments)
    assert shown == f"📄 harbour log.txt · 24 lines · {record['tokens']:,} tokens\n\nHow many ships?"
    assert attachment_card(record) in shown and "ship 7" not in shown


def test_attachments_travel_through_export_and_import_and_old_archives_still_import(store, real_engine, tmp_path):
    session_id = store.create("doc")
    with ChatSession.open(store, real_engine, session_id) as chat:
        list(chat.send("How many ships?", SHORT, attachments=[document()]))
    archive = store.export(session_id, tmp_path / "doc.igchat")
    imported = store.import_file(archive)
    assert store.messages(imported)[0].attachments == store.messages(session_id)[0].attachments
    assert store.messages(imported)[1].attachments == ()

    old = tmp_path / "old.igchat"  # as a version before attachments wrote it
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(old, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "manifest.json":
                manifest = json.loads(data)
                for message in manifest["messages"]:
                    message.pop("attachments", None)
                data = json.dumps(manifest).encode()
            target.writestr(item, data)
    assert store.messages(store.import_file(old))[0].attachments == ()


def test_a_database_from_before_the_attachments_column_opens_and_gains_it(tmp_path):
    store = SessionStore(tmp_path)
    old = store.create("older chat")
    store.add_message(old, "user", "hello", 0, 3)
    drop_search_index(store.db.conn)  # that version had no search index either (its view reads the column)
    store.db.execute("ALTER TABLE messages DROP COLUMN attachments")  # as an earlier version wrote it
    store.db.conn.close()
    reopened = SessionStore(tmp_path)
    assert reopened.messages(old)[0].attachments == ()
    reopened.add_message(old, "user", "again", 3, 6, [{"name": "a.txt", "chars": 3}])
    assert reopened.messages(old)[1].attachments == ({"name": "a.txt", "chars": 3},)


def page_controller(data_dir, engine):
    from chat_service import ChatService

    controller = ChatService(data_dir, loader=lambda *args, **kwargs: engine)
    controller.load(progress=lambda message: None)
    assert controller.host.load_error is None, controller.host.load_error
    return controller


def page_turn(controller, question, documents):
    """A new page session whose first message attaches `documents`; returns the tokens the model read."""
    controller.pages.new_session()
    for _ in controller.page_turns.send(question, documents):
        pass
    return controller.open_sessions.page.last_read_tokens


def test_a_document_is_read_once_for_any_new_chat_also_after_a_restart(tmp_path, real_engine):
    """Counted in tokens the model reads, not timed: the second chat about the same file (page or API), and one
    in a fresh controller (store, prefix finder, empty engine) on the same data dir, read only their question."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from ui.api import ApiOptions, api_routes

    controller = page_controller(tmp_path, real_engine)
    doc = document()
    try:
        first = page_turn(controller, "How many ships?", [doc])
        tokens = controller.store.messages(controller.open_sessions.page.id)[0].attachments[0]["tokens"]
        assert first > tokens  # the first chat reads the whole document
        second = page_turn(controller, "Which ship carried tea?", [doc])
        assert second < 40, f"the second chat read {second} tokens, not just its question"
        assert controller.open_sessions.page.messages[0].attachments[0]["sha256"] == doc.sha256
    finally:
        for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
            chat.close()

    real_engine.reset()
    restarted = page_controller(tmp_path, real_engine)
    try:
        third = page_turn(restarted, "Who logged the ships?", [doc])
        assert third < 40, f"after a restart the chat read {third} tokens"
        # the API starts a new conversation about the same file from the same stored prefix
        from infinigen_core import chat_token_ids
        from sessions.chat import conversation

        content = message_with_attachments("How many passengers?", [doc])
        client = TestClient(FastAPI(routes=api_routes(restarted, ApiOptions())))
        file_part = {"type": "file", "file": {"filename": "harbour log.txt", "file_data":
                     "data:text/plain;base64," + base64.b64encode(DOCUMENT_BYTES).decode()}}
        response = client.post("/v1/chat/completions", json={"max_tokens": 3, "messages": [
            {"role": "user", "content": [file_part, {"type": "text", "text": "How many passengers?"}]}]})
        assert response.status_code == 200, response.text
        prompt_tokens = len(chat_token_ids(real_engine.tokenizer, conversation("", [("user", content)]),
                                           add_generation_prompt=True))
        assert response.json()["usage"]["prompt_tokens"] == prompt_tokens
        assert response.headers["x-infinigen-document-read"] == "harbour log.txt: whole"  # it fits: read whole
        assert restarted.open_sessions.api.last_read_tokens < 40
        # the API's message keeps its attachment's record too: the page shows the card, not the document's text
        stored = restarted.store.messages(restarted.open_sessions.api.id)[0]
        assert [(r["name"], r["sha256"]) for r in stored.attachments] == [("harbour log.txt", doc.sha256)]
        assert stored.attachments[0]["tokens"] == response.json()["usage"]["document_tokens_read"] > 0
    finally:
        for chat in {restarted.open_sessions.page, restarted.open_sessions.api} - {None}:
            chat.close()


def test_the_page_attaches_files_refuses_bad_ones_and_starts_a_new_chat_about_the_file(tmp_path, real_engine):
    import gradio as gr

    from ui.page_actions import PageActions

    controller = page_controller(tmp_path / "data", real_engine)
    actions = PageActions(controller, tmp_path)
    try:
        good, bad = tmp_path / "harbour log.txt", tmp_path / "broken.pdf"
        good.write_bytes(DOCUMENT_BYTES)
        bad.write_bytes(b"%PDF-1.7 not really")
        preview = actions.preview({"text": "How many ships?", "files": [str(good)]})
        assert "harbour log.txt" in preview and "24 lines" in preview and "window" in preview
        session, messages = controller.open_sessions.page.id, len(controller.open_sessions.page.messages)
        with pytest.raises(gr.Error, match="broken.pdf"):
            list(actions.send({"text": "And this?", "files": [str(bad)]}))
        assert controller.open_sessions.page.id == session and len(controller.open_sessions.page.messages) == messages  # nothing stored
        *_, (history, box, *_) = actions.send({"text": "How many ships?", "files": [str(good)]})
        assert history[0]["content"].startswith("📄 harbour log.txt · 24 lines ·") and box["files"] == []
        history, _, info = actions.file_chat()
        assert controller.open_sessions.page.id != session and history == [] and "Attached again" in info
        list(actions.send({"text": "Which ship carried tea?", "files": []}))
        assert controller.open_sessions.page.last_read_tokens < 40  # the document came from the first chat's KV
        assert controller.open_sessions.page.messages[0].attachments[0]["sha256"] == document().sha256
    finally:
        for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
            chat.close()


def test_api_file_parts_are_converted_and_bad_ones_are_a_400_in_openais_shape():
    from ui.api.protocol import ApiError, parse_chat_request

    def request(*parts):
        return parse_chat_request({"messages": [{"role": "user", "content": list(parts)}]}, "m", SHORT)

    def file_part(name, data):
        return {"type": "file", "file": {"filename": name,
                                         "file_data": "data:application/octet-stream;base64," + base64.b64encode(data).decode()}}

    parsed = request(file_part("harbour log.txt", DOCUMENT_BYTES), {"type": "text", "text": "How many ships?"})
    assert parsed.conversation.turns == (("user", message_with_attachments("How many ships?", [document()])),)
    assert [[d.sha256 for d in attached] for attached in parsed.conversation.documents] == [[document().sha256]]
    assert parsed.conversation.questions == ("How many ships?",)  # the title comes from the question
    for parts, words in [((file_part("broken.pdf", b"%PDF-1.7 no"), ), "broken.pdf"),
                         (({"type": "image_url", "image_url": {"url": "x"}},), "file parts"),
                         (({"type": "file", "file": {"file_id": "file-1"}},), "file_id is not"),
                         (({"type": "file", "file": {"file_data": "data:text/plain;base64,@@@"}},), "base64")]:
        with pytest.raises(ApiError) as caught:
            request(*parts)
        body = caught.value.body()["error"]
        assert caught.value.status == 400 and words in body["message"], body
        assert body["param"].startswith("messages[0].content") and body["type"] == "invalid_request_error", body


def test_a_new_chat_about_the_file_gets_the_files_whose_text_the_message_holds_never_a_reference(tmp_path,
                                                                                                  real_engine):
    from chat_service.settings import SettingsForm
    from documents.fitting import READ_ABOVE_TEXT, is_read_above
    from ui.page_actions import PageActions

    controller = page_controller(tmp_path / "data", real_engine)
    controller.settings.apply(real_engine, SettingsForm(max_new_tokens=2))
    actions = PageActions(controller, tmp_path)
    try:
        harbour, tides = tmp_path / "harbour log.txt", tmp_path / "tides.txt"
        harbour.write_bytes(DOCUMENT_BYTES)
        tides.write_bytes(b"High tide at 06:12 and 18:40; low tide at 00:05 and 12:27.")
        list(actions.send({"text": "How many ships?", "files": [str(harbour)]}))
        list(actions.send({"text": "And the tides?", "files": [str(tides), str(harbour)]}))
        chat = controller.open_sessions.page
        attached = [m for m in chat.messages if m.attachments][-1]  # a new file, and the harbour log again
        assert [is_read_above(r) for r in attached.attachments] == [False, True] and READ_ABOVE_TEXT in attached.content
        history, _, info = actions.file_chat()
        assert [d.name for d in actions.pending] == ["tides.txt"] and "Attached again" in info
        assert all(READ_ABOVE_TEXT not in d.text and not is_read_above(d) for d in actions.pending)
    finally:
        for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
            chat.close()
