"""The page's reply as it grows, read from its own route (chat_service/live_replies.py, ui/live_reply.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from chat_service.live_replies import LiveReplies, LiveText
from ui import live_reply
from ui.live_reply import LIVE_REPLY_PATH, GrowingMarkdown, live_reply_routes, rendered

REPLY_ID = "0123456789abcdef" * 2


def test_a_reply_is_opened_only_under_an_id_the_page_makes_and_only_once():
    replies = LiveReplies()
    for wrong in ("", None, "0123", REPLY_ID.upper(), REPLY_ID + "0", "../" + REPLY_ID[3:]):
        assert replies.open(wrong) is None
    reply = replies.open(REPLY_ID)
    assert reply is not None and replies.find(REPLY_ID) is reply
    assert replies.open(REPLY_ID) is None  # a second turn cannot write into the first one's reply


def test_a_reply_grows_until_it_is_finished_and_no_write_comes_after():
    reply = LiveReplies().open(REPLY_ID)
    reply.write("Hel")
    reply.write("Hello")
    assert reply.read() == LiveText("Hello", 2, done=False) and reply.read().started
    reply.finish()
    reply.finish()  # the turn and the handler both finish it: once is what counts
    reply.write("Hello again")
    assert reply.read() == LiveText("Hello", 3, done=True) and reply.read().started


def test_a_reply_refused_before_its_turn_is_done_without_having_started():
    reply = LiveReplies().open(REPLY_ID)
    reply.finish()
    assert reply.read() == LiveText("", 1, done=True) and not reply.read().started


def test_the_oldest_replies_are_forgotten_and_their_readers_told_they_are_done():
    replies = LiveReplies(kept=2)
    ids = [f"{number:032x}" for number in range(3)]
    first, *_ = [replies.open(reply_id) for reply_id in ids]
    assert replies.find(ids[0]) is None and first.read().done
    assert replies.find(ids[1]) is not None and replies.find(ids[2]) is not None


def test_markdown_is_rendered_with_any_html_in_it_shown_as_text():
    html = rendered("**bold** <img src=x onerror=alert(1)> <script>alert(2)</script> [a](javascript:alert(3))\n"
                    "![cat](http://elsewhere.example/cat.png)")
    assert "<strong>bold</strong>" in html
    assert "<img" not in html and "<script" not in html and "&lt;script&gt;" in html
    assert 'href="javascript' not in html
    assert "elsewhere.example" in html and "withheld" in html  # a remote image as the chat shows it


def test_a_growing_reply_renders_as_the_whole_text_does_at_every_length():
    text = ("A first paragraph with *emphasis*.\n\n```python\nx = 1\n\n\ny = 2\n```\n\n| a | b |\n|---|---|\n"
            "| 1 | 2 |\n\nThe last paragraph, still `growing`.")
    markdown = GrowingMarkdown()
    for end in range(1, len(text) + 1):
        assert markdown.render(text[:end]) == rendered(text[:end]), text[:end]
    assert GrowingMarkdown().render(text) == markdown.render(text)


def test_a_reply_rendered_anew_after_its_text_was_replaced():
    markdown = GrowingMarkdown()
    markdown.render("One paragraph.\n\nAnother.")
    assert markdown.render("Different.\n\nText.") == rendered("Different.\n\nText.")


def _client(replies: LiveReplies) -> TestClient:
    return TestClient(Starlette(routes=live_reply_routes(replies)))


def _lines(client: TestClient, reply_id: str) -> list[dict]:
    with client.stream("GET", f"{LIVE_REPLY_PATH}?id={reply_id}") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in response.iter_lines() if line]


def test_the_route_streams_each_change_until_the_reply_is_done(monkeypatch):
    monkeypatch.setattr(live_reply, "WAIT_POLL_S", 0.01)
    monkeypatch.setattr(live_reply, "READ_EVERY_S", 0.01)
    replies = LiveReplies()
    parts = ["The", "The sea", "The sea is **wide**."]

    def turn() -> None:  # the page asks before its turn has begun: the route waits for the reply to open
        time.sleep(0.2)
        reply = replies.open(REPLY_ID)
        for part in parts:
            reply.write(part)
            time.sleep(0.2)
        reply.finish()

    writer = threading.Thread(target=turn)
    writer.start()
    try:
        lines = _lines(_client(replies), REPLY_ID)
    finally:
        writer.join()
    assert [line["html"] for line in lines if not line["done"]] == [rendered(part) for part in parts]
    assert all(line["started"] for line in lines)
    assert lines[-1] == {"html": rendered(parts[-1]), "started": True, "done": True}


def test_a_quiet_stream_gets_a_line_with_nothing_new(monkeypatch):
    monkeypatch.setattr(live_reply, "READ_EVERY_S", 0.01)
    monkeypatch.setattr(live_reply, "KEEPALIVE_S", 0.1)
    replies = LiveReplies()
    reply = replies.open(REPLY_ID)  # a long prefill: no text yet
    threading.Timer(0.5, reply.finish).start()
    lines = _lines(_client(replies), REPLY_ID)
    assert lines[0] == {"html": "", "started": False, "done": False}
    assert {} in lines[1:-1]
    assert lines[-1] == {"html": "", "started": False, "done": True}


def test_the_route_refuses_a_malformed_id_and_gives_up_on_a_turn_that_never_starts(monkeypatch):
    client = _client(LiveReplies())
    assert client.get(f"{LIVE_REPLY_PATH}?id=nothex").status_code == 400
    assert client.get(LIVE_REPLY_PATH).status_code == 400
    monkeypatch.setattr(live_reply, "WAIT_FOR_TURN_S", 0.1)
    monkeypatch.setattr(live_reply, "WAIT_POLL_S", 0.02)
    assert _lines(client, REPLY_ID) == []


@pytest.mark.parametrize("finished_first", [True, False])
def test_a_reader_that_comes_late_gets_the_reply_as_it_is(finished_first):
    replies = LiveReplies()
    reply = replies.open(REPLY_ID)
    reply.write("Already written.")
    if finished_first:
        reply.finish()
    else:
        threading.Timer(0.3, reply.finish).start()
    lines = _lines(_client(replies), REPLY_ID)
    assert lines[-1] == {"html": rendered("Already written."), "started": True, "done": True}
