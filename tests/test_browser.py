"""End to end in a real headless Chromium: send, watch the reply stream, see the panels, reload and resume."""

import os
import time
from pathlib import Path

import pytest

from ui.head_script import THROTTLED_FRAME_MS

from app_server import chromium_page, log_in, running_app

pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
BOT = "#ig-chat [data-testid='bot']"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # the app as it ships (compiled decode step): this page test's waits were tuned against it
    with running_app(tmp_path_factory.mktemp("browser-data"), compiled=True) as running:
        yield running


@pytest.fixture
def page(app):
    with chromium_page(app.url, 1400, 1300) as page:
        log_in(page, app)  # when INFINIGEN_API_KEY is set, the page asks for it first
        page.wait_for_selector("#ig-status:has-text('Ready')", timeout=120_000)
        yield page


def send(page, text: str, by: str = "Enter") -> None:
    """Type a message and send it as a person does: with the Enter key (or by clicking Send)."""
    box = page.locator("#ig-message textarea")
    box.fill(text)
    if by == "Enter":
        box.press("Enter")
    else:
        page.locator("#ig-send").click()


# the newest reply's length as shown, whether the page shows it from its own reader (ui/live_reply.py), how
# many replies the chat shows, and how many readers' elements it holds
SHOWN = f"""() => {{
  const bots = document.querySelectorAll("{BOT}");
  const last = bots[bots.length - 1];
  return [last ? last.innerText.length : 0, !!(last && last.querySelector(".ig-live")), bots.length,
          document.querySelectorAll("#ig-chat .ig-live").length];
}}"""


def reply_lengths_while_streaming(page, count_before: int, timeout_s: float = 240, live: list | None = None,
                                  once_reading=None) -> list[int]:
    """Length of the newest reply, sampled until the Send button's turn is over; into `live`, for each sample,
    (whether the page showed the reply from its own reader, how many replies the chat showed, how many
    readers' elements); `once_reading(page)` is called when the reader first showed text."""
    lengths, deadline = [], time.time() + timeout_s
    page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length > {count_before}", timeout=timeout_s * 1000)
    stable_since = time.time()
    while time.time() < deadline:
        length, from_reader, replies, readers = page.evaluate(SHOWN)
        lengths.append(length)
        if live is not None:
            live.append((from_reader, replies, readers))
        if from_reader and once_reading is not None:
            once_reading(page)
            once_reading = None
        if len(lengths) > 1 and lengths[-1] != lengths[-2]:
            stable_since = time.time()
        busy = any(word in page.locator("#ig-status").inner_text() for word in ("Generating", "Reading"))
        if not busy and time.time() - stable_since > 3:  # the status refreshes once a second
            break
        time.sleep(0.05)
    return lengths


def test_chat_streams_shows_panels_and_resumes_after_reload(page, app):
    ARTIFACTS.mkdir(exist_ok=True)
    box = page.locator("#ig-message textarea")
    box.fill("Describe the sea")
    box.press("Shift+Enter")  # a new line, not a send
    # a reply of ~77 tokens (greedy): streamed over several of the reader's lines, not over in one
    box.press_sequentially("in three long paragraphs.")
    assert box.input_value() == "Describe the sea\nin three long paragraphs."
    box.press("Enter")
    live: list[tuple[bool, int, int]] = []

    def regenerate_while_replying(page) -> None:  # refused (one reply at a time): its reader must show nothing
        page.locator("button:has-text('Regenerate')").click()

    lengths = reply_lengths_while_streaming(page, 0, live=live, once_reading=regenerate_while_replying)
    assert box.input_value() == ""  # sent: the box is cleared
    assert lengths[-1] > 20
    # the reply streamed from the page's own reader, shown once, by one reader, and the chat's own message took
    # its place
    assert any(from_reader for from_reader, *_ in live) and not live[-1][0]
    assert {replies for _, replies, _ in live} == {1} and max(readers for *_, readers in live) == 1
    page.wait_for_timeout(1500)  # a refused reader gives up after its own reply ends: nothing of it shows
    assert page.locator("#ig-chat .ig-live").count() == 0
    # streamed: the page's reader showed part of the reply before all of it (the first text comes at once, then
    # every 0.5 s; a short reply at ~50 tokens/s may take only one more, so one partial length is what is sure)
    assert {n for n, (from_reader, *_) in zip(lengths, live) if from_reader and 0 < n < lengths[-1]}
    first_reply = page.locator(BOT).last.inner_text()

    # the live panels are drawn in the browser (Vega) from the small tables the server sends after decode steps;
    # the heat map is a PNG of one pixel per layer and step, scaled up by the browser
    for panel in ("#ig-memory", "#ig-fetch", "#ig-timing"):
        page.wait_for_selector(f"{panel} canvas, {panel} svg.marks", timeout=30_000)
    heat_map = page.wait_for_selector("#ig-sparsity img[src^='data:image/png']", timeout=30_000)
    assert heat_map.evaluate("img => img.naturalHeight") == 30  # SmolLM2's 30 layers, decoded by the browser
    assert heat_map.evaluate("img => img.complete && img.naturalWidth > 0")
    page.screenshot(path=str(ARTIFACTS / "browser-mid-conversation.png"), full_page=True)

    page.reload()
    page.wait_for_selector("#ig-status:has-text('Ready')", timeout=60_000)
    page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length == 1", timeout=30_000)
    assert page.locator(BOT).last.inner_text() == first_reply
    assert "Describe the sea" in page.locator("#ig-sessions").inner_html() or \
        "Describe the sea" in page.locator("#ig-sessions input").input_value()
    page.wait_for_selector("#ig-session-info:has-text(' on disk')", timeout=30_000)
    assert "2 messages" in page.locator("#ig-session-info").inner_text()

    send(page, "Now in one sentence.", by="click")
    lengths = reply_lengths_while_streaming(page, 1)
    assert lengths[-1] > 0
    assert page.locator(BOT).count() == 2  # the conversation went on where it was
    page.screenshot(path=str(ARTIFACTS / "browser-after-reload.png"), full_page=True)

    # a pasted document (the project's own ~2.4k-token calibration text): reading it shows progress, and
    # at this length the sparse layers fetch a fraction of the context
    from infinigen_core.calibration import calibration_text

    send(page, "Here is a story I am writing:\n\n" + calibration_text() + "\n\nWhat is it about, in one sentence?")
    page.wait_for_selector("#ig-status:has-text('Reading your message')", timeout=60_000)
    lengths = reply_lengths_while_streaming(page, 2)
    assert lengths[-1] > 0 and page.locator(BOT).count() == 3
    page.wait_for_selector("#ig-session-info:has-text('6 messages')", timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "browser-long-document.png"), full_page=True)
    if os.environ.get("UPDATE_SCREENSHOT"):  # the README's picture: refreshed on request, not by every test run
        page.screenshot(path=str(ROOT / "docs" / "screenshot.png"), full_page=True)

    # a conversation through the OpenAI-compatible API shows up in the sidebar, marked as such
    import json
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": "Hello from a script"}], "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {app.auth[1]}"} if app.auth else {})
    request = urllib.request.Request(f"{app.url}v1/chat/completions", body, headers)
    with urllib.request.urlopen(request, timeout=240) as response:
        assert response.status == 200
    page.locator("#ig-sessions input").click()
    page.wait_for_selector("[role='option']:has-text('API · Hello from a script')", timeout=30_000)


# counts, under the page's own scripts, the frames that Gradio's status trackers ask the browser for and the
# timeouts they get instead (ui/head_script.py)
# and those of Svelte's animation loop, which steps the trackers' loaders (`loop`: asked, deferred likewise)
COUNT_STATUS_TRACKER_FRAMES = """(() => {
  const zero = () => ({asked: 0, deferred: 0, loopAsked: 0, loopDeferred: 0});
  window.__igFrames = zero();
  window.__igZero = () => { window.__igFrames = zero(); };
  const fromTracker = () => (new Error().stack || "").includes("statustracker");
  const fromLoop = () => (new Error().stack || "").includes("at Object.tick");
  const frame = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = (callback) => {
    if (fromTracker()) window.__igFrames.asked++;
    else if (fromLoop()) window.__igFrames.loopAsked++;
    return frame(callback);
  };
  const later = window.setTimeout.bind(window);
  window.setTimeout = (callback, ms, ...rest) => {
    if (ms === %d && fromTracker()) window.__igFrames.deferred++;
    else if (ms === %d && fromLoop()) window.__igFrames.loopDeferred++;
    return later(callback, ms, ...rest);
  };
})();""" % (THROTTLED_FRAME_MS, THROTTLED_FRAME_MS)


def test_an_idle_page_does_not_redraw_for_gradios_status_trackers_every_frame(app):
    with chromium_page(app.url, 1400, 1300, init_script=COUNT_STATUS_TRACKER_FRAMES) as page:
        log_in(page, app)
        page.wait_for_selector("#ig-status:has-text('Ready')", timeout=120_000)
        page.evaluate("window.__igZero()")
        page.wait_for_timeout(3000)  # a few of the panels' ticks
        first = page.evaluate("window.__igFrames")
        page.evaluate("window.__igZero()")
        page.wait_for_timeout(3000)
        frames = page.evaluate("window.__igFrames")
    # the trackers' loops still run (their elapsed seconds still count), once a second rather than at every
    # display frame; a Gradio without the leak would count no deferred frames here, and the script could go
    assert frames["asked"] == 0, frames
    assert frames["deferred"] > 0, frames
    # the loader over the loading app springs on for seconds after it has gone: its loop's frames are deferred
    # too (without the script, 25-45 a second asked in these seconds), and none is asked with no loader shown
    assert first["loopAsked"] == 0 and frames["loopAsked"] == 0, (first, frames)
    assert first["loopDeferred"] + frames["loopDeferred"] > 0, (first, frames)
