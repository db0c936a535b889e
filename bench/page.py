"""Does the open page slow the model? The same greedy reply, decoded with no page open (through the
OpenAI-compatible API) and sent through the page in headless Chromium, interleaved round by round.

    python -m bench page [--max-new-tokens 300] [--rounds 5] [--save results/page.json]

One `python app.py` on a free port and a throw-away data directory serves both. Each round:
(a) the API, no browser running: a streamed request with the fixed prompt, max_tokens N, temperature 0;
(b) Chromium opens the page (live panels tab showing), starts a new session, types the same prompt and presses
Enter; the browser is closed after the reply.
Both rates are measured the same way, as the client sees the server generate: (tokens - 1) / (seconds from the
first streamed text to the last), so the prefill is left out. The API's client times its stream chunks; the
page records, with a MutationObserver, when the reply's text last grew. Tokens are the API's
usage.completion_tokens; the page's reply is the same greedy reply (checked: `same_reply`), so it has as many.
The page shows a reply's text every 0.5 s (ui/page_turns.py), so a reply must last several seconds for its
first and last text to time it well: 300 tokens at ~50 tokens/s. The machine's speed drifts between rounds,
so the figure to quote is the median of the rounds' own ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
BOT = "#ig-chat [data-testid='bot']"
# the page's own clock: when the newest reply first showed text and when it last grew. It reads textContent,
# which needs no layout (innerText would force one at every change: the benchmark would slow what it measures)
WATCH = """() => {
  window.__igTimes = {first: null, last: null, text: ""};
  const count = document.querySelectorAll("%s").length;
  new MutationObserver(() => {
    const bots = document.querySelectorAll("%s");
    if (bots.length <= count) return;
    const text = bots[bots.length - 1].textContent;
    if (text.length && text !== window.__igTimes.text) {
      const now = performance.now();
      if (window.__igTimes.first === null) window.__igTimes.first = now;
      window.__igTimes.last = now;
      window.__igTimes.text = text;
    }
  }).observe(document.querySelector("#ig-chat"), {subtree: true, childList: true, characterData: true});
}""" % (BOT, BOT)


def _api_reply(url: str, max_new_tokens: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_new_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}v1/chat/completions", body, {"Content-Type": "application/json"})
    first = last = None
    text, tokens = "", 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text += choice["delta"]["content"]
    return {"tokens": tokens, "seconds": last - first, "text": text}


def _launch(playwright):
    args = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)


def _page_reply(url: str, playwright) -> dict:
    browser = _launch(playwright)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        page.goto(url)
        page.wait_for_selector("#ig-status:has-text('Ready')", timeout=120_000)
        page.locator("#ig-new").click()
        page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length == 0", timeout=60_000)
        page.evaluate(WATCH)
        box = page.locator("#ig-message textarea")
        box.fill(PROMPT)
        box.press("Enter")
        page.wait_for_function("window.__igTimes.first !== null", timeout=600_000, polling=100)
        # the turn is over when the status line no longer says it is generating and the text stopped growing
        while True:
            time.sleep(1.0)
            status = page.locator("#ig-status").inner_text()
            if not any(word in status for word in ("Generating", "Reading")):
                quiet = page.evaluate("performance.now() - window.__igTimes.last")
                if quiet > 3000:
                    break
        times = page.evaluate("window.__igTimes")
        return {"seconds": (times["last"] - times["first"]) / 1000, "text": page.locator(BOT).last.inner_text()}
    finally:
        browser.close()


def _set_max_new_tokens(url: str, max_new_tokens: int) -> None:
    """The page's settings: the defaults (greedy) with the reply's length capped like the API request's."""
    from gradio_client import Client

    from chat_service.settings import Settings

    s = Settings()
    Client(url, verbose=False).predict(s.policy, s.alpha, s.budget, s.partial_ratio, s.pool_limit, False, 0.0, 1.0,
                                       0, 1.0, max_new_tokens, s.min_fetch_tokens, api_name="/apply_settings")


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def measure_rounds(max_new_tokens: int, rounds: int, show=print) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from app_server import running_app
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError("Debian chromium is not installed (apt-get install chromium)")
    rows = []
    show("| round | tokens | API, no page (tokens/s) | page open (tokens/s) | ratio | same reply |")
    show("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="page-bench-") as folder, running_app(Path(folder)) as app, \
            sync_playwright() as playwright:
        _set_max_new_tokens(app.url, max_new_tokens)
        _api_reply(app.url, 8)  # warm-up: first-call costs out of the measured rounds
        for number in range(1, rounds + 1):
            api = _api_reply(app.url, max_new_tokens)
            time.sleep(2)
            page = _page_reply(app.url, playwright)
            time.sleep(2)
            row = {"round": number, "tokens": api["tokens"],
                   "api_tokens_per_s": (api["tokens"] - 1) / api["seconds"],
                   "page_tokens_per_s": (api["tokens"] - 1) / page["seconds"],
                   "same_reply": _same(api["text"], page["text"])}
            row["ratio"] = row["page_tokens_per_s"] / row["api_tokens_per_s"]
            show(f"| {number} | {row['tokens']} | {row['api_tokens_per_s']:.2f} | {row['page_tokens_per_s']:.2f} | "
                 f"{row['ratio']:.3f} | {row['same_reply']} |")
            rows.append(row)
    api_rate = sum(r["api_tokens_per_s"] for r in rows) / len(rows)
    page_rate = sum(r["page_tokens_per_s"] for r in rows) / len(rows)
    # the machine's speed drifts from round to round: the median of the ratios within a round is the robust figure
    median_ratio = statistics.median(r["ratio"] for r in rows)
    show(f"mean rates: API {api_rate:.2f}, page {page_rate:.2f} tokens/s (ratio {page_rate / api_rate:.3f}); "
         f"median of the rounds' ratios {median_ratio:.3f}")
    return {"max_new_tokens": max_new_tokens, "prompt": PROMPT, "rows": rows, "api_tokens_per_s": api_rate,
            "page_tokens_per_s": page_rate, "ratio": page_rate / api_rate, "median_round_ratio": median_ratio}
