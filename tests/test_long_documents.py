"""Documents longer than the window through both faces: the API's `file` part and the page's attach box read
the passages nearest the question, say which pages were read, and the stored message keeps it."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import urllib.parse

import pytest
from test_passages import FACT, QUESTION, pdf_of_pages

from documents import Document, attachment_card, convert_bytes, displayed_message, message_with_attachments
from documents.fitting import READ_ABOVE, READ_ABOVE_TEXT, fit_message
from documents.passage_index import PassageIndex, prune_folder
from infinigen_core import SamplingConfig

PDF_PAGES, FACT_PAGE = 80, 57


@pytest.fixture(scope="module")
def long_pdf() -> bytes:
    return pdf_of_pages(PDF_PAGES, fact_page=FACT_PAGE)


def pages_read(description: str) -> set[int]:
    """'report.pdf: pages 1, 56-58' -> {1, 56, 57, 58}"""
    found: set[int] = set()
    for part in description.split(": ", 1)[1].removeprefix("pages ").removeprefix("page ").split(", "):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def text_document(text: str, name: str) -> Document:
    return Document(name=name, kind="text", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                    size_bytes=len(text.encode()))


def test_the_converter_finds_each_pdf_page_in_the_text(long_pdf):
    document = convert_bytes("report.pdf", long_pdf)
    starts = document.page_starts
    assert starts is not None and len(starts) == PDF_PAGES and starts[0] == 0
    fact_at = document.text.index("Biscuit")
    assert starts[FACT_PAGE - 1] <= fact_at < starts[FACT_PAGE]  # the fact stands inside its own page


def test_only_what_does_not_fit_is_read_by_passages_the_longest_first():
    short, long, longer = (text_document(f"{word} " * size, f"{word}.txt")
                           for word, size in (("short", 10), ("long", 300), ("longer", 900)))
    asked: list[str] = []

    def read(document: Document) -> Document:
        asked.append(document.name)
        return Document(name=document.name, kind="text", text="a passage", sha256=document.sha256,
                        size_bytes=document.size_bytes, read=f"{document.name}: lines 1-2")

    room = 2_000  # characters of the message
    fitted = fit_message("Q?", [short, long, longer], lambda message: len(message) <= room, read)
    assert asked == ["longer.txt"] and [d.read for d in fitted] == [None, None, "longer.txt: lines 1-2"]
    fitted = fit_message("Q?", [short, long, longer], lambda message: len(message) <= 300, read)
    assert asked[1:] == ["longer.txt", "long.txt"] and fitted[0].read is None
    assert fit_message("Q?", [short], lambda message: True, read) == (short,)


def test_a_file_attached_again_is_not_read_again_where_the_conversation_holds_its_text():
    notes, long = text_document("the cat is called Biscuit " * 5, "notes.txt"), text_document("word " * 900, "long.txt")
    passage = Document(name="long.txt", kind="text", text="word word", sha256=long.sha256,
                       size_bytes=long.size_bytes, read="long.txt: lines 1-2")
    earlier = [message_with_attachments("What is the cat called?", [notes, passage])]
    fitted = fit_message("And again?", [notes, long], lambda message: len(message) <= 400, lambda d: passage, earlier)
    assert [d.read for d in fitted] == ["notes.txt: whole" + READ_ABOVE, "long.txt: lines 1-2" + READ_ABOVE]
    assert all(d.text == READ_ABOVE_TEXT for d in fitted)  # a few tokens, not the text once more
    other = dataclasses.replace(passage, text="other words", read="long.txt: lines 7-8")  # another selection
    fitted = fit_message("Q?", [notes, long], lambda message: len(message) <= 400, lambda d: other, earlier)
    assert fitted[1] == other and fitted[0].read.endswith(READ_ABOVE)
    assert fit_message("Q?", [notes], lambda message: True, lambda d: d, ["unrelated"]) == (notes,)


def test_the_passages_folder_is_bounded_by_use(tmp_path):
    documents = [text_document(("word " * 4000) + str(n), f"d{n}.txt") for n in range(4)]
    paths = []
    for document in documents:
        index = PassageIndex.open(tmp_path, document, 100)
        paths.append(index.path)
        index.close()
    size = paths[0].stat().st_size
    PassageIndex.open(tmp_path, documents[0], 100).close()  # used again: now the most recent
    removed = prune_folder(tmp_path, limit_bytes=2 * size + size // 2, keep=paths[3])
    assert removed == [paths[1], paths[2]] and sorted(tmp_path.iterdir()) == sorted([paths[0], paths[3]])


def api_client(controller):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from ui.api import ApiOptions, api_routes

    return TestClient(FastAPI(routes=api_routes(controller, ApiOptions())))


def test_a_pdf_several_windows_long_is_read_by_passages_through_the_api(tmp_path, real_engine, long_pdf):
    from test_document_sessions import page_controller

    controller = page_controller(tmp_path / "data", real_engine)
    client = api_client(controller)
    file_part = {"type": "file", "file": {"filename": "report.pdf",
                                          "file_data": "data:application/pdf;base64," + base64.b64encode(long_pdf).decode()}}
    first = [{"role": "user", "content": [file_part, {"type": "text", "text": QUESTION}]}]
    try:
        response = client.post("/v1/chat/completions", json={"messages": first, "max_tokens": 16, "temperature": 0})
        assert response.status_code == 200, response.text
        header = urllib.parse.unquote(response.headers["x-infinigen-document-read"])
        assert header.startswith("report.pdf: pages 1, ") and FACT_PAGE in pages_read(header), header
        usage = response.json()["usage"]
        assert 0 < usage["document_tokens_read"] <= 200 and usage["prompt_tokens"] < 400, usage  # not 40,000
        answer = response.json()["choices"][0]["message"]["content"]
        assert "biscuit" in answer.lower(), answer

        session_id = response.headers["x-infinigen-session"]
        user = controller.store.messages(session_id)[0]
        (record,) = user.attachments
        assert record["read"] == header and record["pages"] == PDF_PAGES and FACT in user.content.replace("’", "'")
        card = attachment_card(record)
        assert card.startswith(f"📄 report.pdf · {PDF_PAGES} pages · read: pages 1, ") and "tokens" in card
        assert displayed_message(user.content, user.attachments) == f"{card}\n\n{QUESTION}"
        exported = controller.store.import_file(controller.store.export(session_id, tmp_path / "report.igchat"))
        assert controller.store.messages(exported)[0].attachments == user.attachments  # export keeps it

        # the client sends the conversation on: the first turn comes out as stored, so the session continues
        follow = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say it again."}]
        again = client.post("/v1/chat/completions", json={"messages": follow, "max_tokens": 4})
        assert again.status_code == 200, again.text
        assert again.headers["x-infinigen-session"] == session_id and again.headers["x-infinigen-continued"] == "true"
        assert urllib.parse.unquote(again.headers["x-infinigen-document-read"]) == header
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"]

        # passages that cannot be indexed (here the folder is a file) are a clear error, and nothing is stored
        blocked = tmp_path / "not-a-folder"
        blocked.write_text("")
        controller.documents.folder = blocked
        sessions = len(controller.store.list())
        refused = client.post("/v1/chat/completions", json={"messages": first, "max_tokens": 4})
        assert refused.status_code == 500 and "could not be indexed" in refused.json()["error"]["message"]
        assert len(controller.store.list()) == sessions
    finally:
        for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
            chat.close()


def test_the_page_says_so_before_sending_and_the_card_lists_the_pages_read(tmp_path, real_engine, long_pdf):
    from test_document_sessions import page_controller

    from ui.page_actions import PageActions

    controller = page_controller(tmp_path / "data", real_engine)
    controller.settings.current = dataclasses.replace(controller.settings.current,
                                                      sampling=SamplingConfig(max_new_tokens=4))
    actions = PageActions(controller, tmp_path)
    path = tmp_path / "report.pdf"
    path.write_bytes(long_pdf)
    try:
        preview = actions.preview({"text": QUESTION, "files": [str(path)]})
        assert "x this model's window: the passages nearest each question will be read" in preview, preview
        assert "(for this question: pages 1, " in preview and "It does not fit" not in preview, preview
        *_, (history, box, *_) = actions.send({"text": QUESTION, "files": [str(path)]})
        card = history[0]["content"].split("\n")[0]
        assert card.startswith(f"📄 report.pdf · {PDF_PAGES} pages · read: pages 1, "), card
        assert FACT_PAGE in pages_read("report.pdf: " + card.split("read: ")[1].split(" · ")[0])
        stored = controller.store.messages(controller.open_sessions.page.id)[0]
        assert stored.attachments[0]["read"].startswith("report.pdf: pages 1, ") and box["files"] == []

        # a new chat whose question selects the same passages starts from the first chat's stored KV: the
        # passages come before the question, byte for byte, so only the question is read
        controller.pages.new_session()
        *_, (history, *_) = actions.send({"text": "Which name has the harbour master's cat?", "files": [str(path)]})
        again = controller.store.messages(controller.open_sessions.page.id)[0]
        assert again.attachments[0]["read"] == stored.attachments[0]["read"]
        read = controller.open_sessions.page.last_read_tokens
        assert read < 30 < stored.attachments[0]["tokens"], f"the second chat read {read} tokens"

        # the same file attached again in this chat, its question selecting the same passages: the passages are
        # in the conversation already, so the new message refers to them and reads only its own few tokens
        *_, (history, *_) = actions.send({"text": "Which name has the harbour master's cat?", "files": [str(path)]})
        repeated = controller.store.messages(controller.open_sessions.page.id)[-2]
        assert repeated.attachments[0]["read"] == stored.attachments[0]["read"] + READ_ABOVE
        assert "already read above" in history[-2]["content"].split("\n")[0]
        read = controller.open_sessions.page.last_read_tokens
        # the question, the template's and a reference's few tokens; reading the passages again costs more
        assert read < stored.attachments[0]["tokens"], f"read {read} tokens again"
    finally:
        for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
            chat.close()


def test_the_header_names_each_file_and_survives_any_file_name():
    from ui.api.serving import DocumentsRead

    read = DocumentsRead(("report.pdf: pages 1, 36-38", "résumé; 100%.txt: whole", "报告.txt: lines 1-12"), 90)
    header = read.header()
    assert header.isascii() and header.startswith("report.pdf: pages 1, 36-38; r%C3%A9sum%C3%A9%3B 100%25.txt")
    assert [urllib.parse.unquote(part) for part in header.split("; ")] == list(read.descriptions)
