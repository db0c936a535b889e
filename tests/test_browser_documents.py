"""End to end in a real headless Chromium: attach a file through the message box, see its card and window
share before sending, get an answer, then a second chat about the same file that does not read it again."""

import os
import re
from pathlib import Path

import pytest
from gradio_client import Client

from app_server import chromium_page, log_in, running_app

pytest.importorskip("playwright.sync_api")

from test_browser import BOT, reply_lengths_while_streaming  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
SHIPS = ["Albatross", "Bellflower", "Cormorant", "Dauntless", "Evening Star", "Fairwind", "Gannet", "Heron"]
CARGO = ["tea", "wool", "salt", "timber", "coal", "grain", "copper", "linen"]


def harbour_log() -> str:
    """A few hundred tokens of made-up text (no file in the repo needed)."""
    lines = ["Harbour log of Port Ellery, spring week twelve", ""]
    for day, (ship, cargo) in enumerate(zip(SHIPS * 3, CARGO[3:] + CARGO * 2), start=1):
        lines.append(f"Day {day}: the {ship} came in on the morning tide with {cargo}; the harbour master, "
                     f"Ada Quill, logged it at berth {day % 5 + 1}.")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("browser-documents")) as running:
        yield running


@pytest.fixture
def page(app):
    with chromium_page(app.url, 1280, 800) as page:
        log_in(page, app)  # when INFINIGEN_API_KEY is set, the page asks for it first
        page.wait_for_selector("#ig-status:has-text('Ready')", timeout=120_000)
        yield page


def ask(page, question: str, replies_before: int) -> None:
    box = page.locator("#ig-message textarea")
    box.fill(question)
    box.press("Enter")
    reply_lengths_while_streaming(page, replies_before)
    assert page.locator(BOT).count() == replies_before + 1 and page.locator(BOT).last.inner_text().strip()


def test_attach_a_file_ask_and_ask_again_in_a_new_chat_without_reading_it_again(page, app, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    document = tmp_path / "harbour log.txt"
    document.write_text(harbour_log())
    status = Client(app.url, verbose=False, auth=app.auth)

    # attach through the message box's own file input: its card and the window share show before sending
    page.locator("#ig-message input[type=file]").set_input_files(str(document))
    cards = page.locator("#ig-attachments")
    page.wait_for_selector("#ig-attachments:has-text('harbour log.txt')", timeout=60_000)
    page.wait_for_selector("#ig-attachments:has-text('window')", timeout=30_000)
    doc_tokens = int(re.search(r"harbour log\.txt.*?([\d,]+) tokens", cards.inner_text()).group(1).replace(",", ""))
    assert 200 < doc_tokens < 2000, cards.inner_text()
    assert "of the model's 8,192-token window" in cards.inner_text()

    ask(page, "Which ship carried tea?", 0)
    # the chat shows the attachment as a card, not the document's text
    user = page.locator("#ig-chat [data-testid='user']").last.inner_text()
    assert "harbour log.txt" in user and "Ada Quill" not in user
    page.wait_for_selector("#ig-attachments:has-text('Read all')", timeout=30_000)
    first_read = status.predict(api_name="/status")["last_read_tokens"]
    assert first_read > doc_tokens  # the first chat reads the whole document
    page.screenshot(path=str(ARTIFACTS / "browser-document-chat.png"))
    if os.environ.get("UPDATE_SCREENSHOT"):  # the README's picture: refreshed on request
        page.screenshot(path=str(ROOT / "docs" / "documents.png"))

    # a new chat about the same file: attached again, and its KV comes from the first chat's stored chunks
    page.locator("#ig-file-chat").click()
    page.wait_for_selector("#ig-attachments:has-text('Attached again')", timeout=60_000)
    page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length == 0", timeout=30_000)
    ask(page, "Who logged the ships?", 0)
    page.wait_for_selector("#ig-attachments:has-text('from the stored KV of an earlier chat')", timeout=30_000)
    note = cards.inner_text()
    read = int(re.search(r"Read ([\d,]+) new tokens", note).group(1).replace(",", ""))
    assert read < 40, note  # the question and the chat template's tokens, not the document again
    assert status.predict(api_name="/status")["last_read_tokens"] == read
    assert "harbour log.txt" in page.locator("#ig-chat [data-testid='user']").last.inner_text()


def test_a_pdf_longer_than_the_window_says_so_and_its_card_lists_the_pages_read(page, tmp_path):
    """Issue 32 through the page's own file input: an 80-page PDF (~40,000 tokens, 5x the window) with a fact on
    page 57 is read by passages, said before sending, and the sent message's card names the pages read."""
    from test_passages import QUESTION, pdf_of_pages

    document = tmp_path / "report.pdf"
    document.write_bytes(pdf_of_pages(80, fact_page=57))
    page.locator("#ig-new").click()
    page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length == 0", timeout=30_000)
    page.locator("#ig-message input[type=file]").set_input_files(str(document))
    page.wait_for_selector("#ig-attachments:has-text('the passages nearest each question will be read')",
                           timeout=120_000)
    assert "It does not fit" not in page.locator("#ig-attachments").inner_text()
    ask(page, QUESTION, 0)
    card = page.locator("#ig-chat [data-testid='user']").last.inner_text()
    found = re.search(r"report\.pdf · 80 pages · read: pages ([\d, -]+)", card)
    assert found, card
    pages = {n for part in found.group(1).split(", ") for n in
             range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
    assert 1 in pages and 57 in pages, card
