"""Searching saved chats in the running app: the /search endpoint for scripts and the sidebar's box in
Chromium, over a store of 300 sessions written beside the app (issue 32)."""

from __future__ import annotations

import pytest
from gradio_client import Client

from sessions import SessionStore

from app_server import chromium_page, running_app

SESSIONS = 300
# issue 34: an assistant message that tried to cover the page with a fake key prompt
OVERLAY = ('<div id="ig-trap" style="position:fixed;inset:0;z-index:99999;background:white">Session expired: '
           'paste your API key <input name="key"></div> The lighthouse keeper waves.')
LATER = 20  # turns after the target's matching one: the chat opens scrolled to its end


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("search-data")
    store = SessionStore(data_dir)
    for n in range(SESSIONS):
        session_id = store.create(f"Chat {n}")
        store.add_messages(session_id, [("user", f"question {n} about the weather", 0, 0),
                                        ("assistant", f"answer {n}: it may rain", 0, 0)])
    target = store.create("Trip planning")
    store.add_messages(target, [("user", "Where did I leave the zeppelin tickets?", 0, 0),
                                ("assistant", "In the blue folder.", 0, 0)]
                       + [(role, f"later {role} message {n}", 0, 0) for n in range(LATER) for role in ("user", "assistant")])
    overlay = store.create("Overlay attempt")
    store.add_messages(overlay, [("user", "what does the lighthouse keeper say?", 0, 0), ("assistant", OVERLAY, 0, 0)])
    del store  # the app opens the database itself
    with running_app(data_dir) as running:
        yield running, target


def test_search_endpoint_finds_one_session_among_hundreds_and_survives_query_syntax(app):
    app, target = app
    client = Client(app.url, verbose=False, auth=app.auth)
    hits = client.predict("zeppelin", api_name="/search")
    assert [hit["session_id"] for hit in hits] == [target]
    assert hits[0]["title"] == "Trip planning" and hits[0]["message_index"] == 0
    assert "<mark>zeppelin</mark>" in hits[0]["snippet"]
    for hostile in ('"', "zeppelin AND", "NEAR(", "*", "tickets) OR ("):
        assert isinstance(client.predict(hostile, api_name="/search"), list), hostile  # never an error


# whether the chat shows the message holding a text inside its scrolled area
IN_VIEW = """(text) => {
  const message = [...document.querySelectorAll('#ig-chat [data-testid="user"], #ig-chat [data-testid="bot"]')]
    .find(element => element.textContent.includes(text));
  let area = message.parentElement;
  while (area && area.scrollHeight <= area.clientHeight + 1) area = area.parentElement;
  const shown = area.getBoundingClientRect(), box = message.getBoundingClientRect();
  return box.bottom > shown.top && box.top < shown.bottom;
}"""


def test_the_sidebar_search_opens_the_matching_chat_scrolled_to_the_matching_message(app):
    app, _ = app
    with chromium_page(app.url) as page:
        page.locator("#ig-search textarea, #ig-search input").first.fill("zeppel")  # an unfinished last word
        snippets = page.locator("#ig-search-snippets")
        snippets.locator("mark").first.wait_for(timeout=60_000)
        assert "Trip planning" in snippets.inner_text()
        page.locator("#ig-search-hits input").first.click()
        page.get_by_role("option", name="Trip planning").click()
        page.locator("#ig-chat").get_by_text("In the blue folder.").wait_for(timeout=60_000)
        found = page.locator("#ig-chat .ig-found")  # outlined for a few seconds
        found.wait_for(timeout=30_000)
        assert "zeppelin tickets" in found.inner_text()
        page.wait_for_function(IN_VIEW, arg="zeppelin tickets", timeout=10_000)
        assert not page.evaluate(IN_VIEW, f"later assistant message {LATER - 1}")  # the chat's end is out of view
        page.locator("#ig-chat .ig-found").wait_for(state="detached", timeout=30_000)  # briefly


# the innermost element holding the message's would-be overlay: how it is placed and whether it fills the page
TRAP = """() => {
  const found = [...document.querySelectorAll('#ig-chat div')]
    .filter(element => element.textContent.trim().startsWith('Session expired'));
  const trap = found[found.length - 1], box = trap.getBoundingClientRect();
  return {position: getComputedStyle(trap).position, styled: trap.hasAttribute('style'),
          fillsPage: box.width >= window.innerWidth - 1 && box.height >= window.innerHeight - 1};
}"""


def test_a_message_that_tries_to_cover_the_page_renders_as_plain_content(app):
    """Issue 34: a stored assistant message with a fixed, full-page element shows as text in the chat; the page
    around it stays usable (the new-session button takes a click)."""
    app, _ = app
    with chromium_page(app.url) as page:
        page.locator("#ig-search textarea, #ig-search input").first.fill("lighthouse keeper")
        page.locator("#ig-search-snippets mark").first.wait_for(timeout=60_000)
        page.locator("#ig-search-hits input").first.click()
        page.get_by_role("option", name="Overlay attempt").click()
        page.locator("#ig-chat").get_by_text("The lighthouse keeper waves.").wait_for(timeout=60_000)
        trap = page.evaluate(TRAP)
        assert trap == {"position": "static", "styled": False, "fillsPage": False}
        page.locator("#ig-new").click(timeout=10_000)  # nothing lies over it
