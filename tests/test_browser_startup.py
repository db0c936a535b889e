"""In a real headless Chromium, the moment the app starts: a question typed and sent while the model still
loads waits for it and is answered once it is ready, with no error shown."""

import time
import urllib.error
import urllib.request

import pytest

from app_server import chromium_page, running_app

pytest.importorskip("playwright.sync_api")

BOT = "#ig-chat [data-testid='bot']"


def _ready(url: str) -> bool:
    """Whether the model is ready: /v1/models answers 503 while it loads (a cheap request for a busy server)."""
    try:
        with urllib.request.urlopen(f"{url}v1/models", timeout=120) as response:
            return response.status == 200
    except urllib.error.HTTPError as error:
        assert error.code == 503, error
        return False


def test_a_message_sent_while_the_model_loads_is_answered_once_it_is_ready(tmp_path):
    # the app as it ships (compiling its decode step): the page answers while the model still loads
    with running_app(tmp_path, until_ready=False, compiled=True) as app:
        url = app.url
        with chromium_page(url, 1400, 1000) as page:
            box = page.locator("#ig-message textarea")
            box.wait_for(timeout=60_000)
            box.fill("What is the capital of France?")
            loading_when_sent = not _ready(url)
            box.press("Enter")
            waiting_seen, loading_after = False, None
            sent_at = time.time()
            while page.locator(BOT).count() == 0:
                assert time.time() < sent_at + 600, "no reply"
                status = page.locator("#ig-status").inner_text()
                waiting_seen = waiting_seen or "waits for the model" in status
                if loading_after is None and time.time() > sent_at + 5:  # two ticks of the status line later
                    loading_after = not _ready(url)
                assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").first.inner_text()
                time.sleep(0.2)
            page.wait_for_function(f"document.querySelector(\"{BOT}\").innerText.length > 0", timeout=120_000)
            assert page.locator(".toast-body").count() == 0  # no error shown, ever
            assert page.locator("#ig-chat [data-testid='user']").count() == 1  # sent once, answered once
            assert box.input_value() == ""  # the box was emptied when the turn started
    assert loading_when_sent, "the model was ready before the message was sent: nothing waited"
    if loading_after:  # the model was still loading a tick after the send: the status line said so
        assert waiting_seen
