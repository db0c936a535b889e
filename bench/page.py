"""Does chatting in the page slow the model? The same greedy reply decoded through the OpenAI-compatible API
(no browser running) and sent from the page itself in headless Chromium, interleaved round by round, for a
short conversation and a long one.

    python -m bench page [--max-new-tokens 200] [--rounds 5] [--cases short,long] [--save results/page.json]
    python -m bench page --without-browser ...   # the page's turn through its handler and Gradio's queue only

One `python app.py` on a free port and a throw-away data directory serves every round. Each round runs, for
each case, (a) the API: a streamed request with the case's messages, max_tokens N, temperature 0; then
(b) the page: Chromium opens the page (live panels tab showing) on the case's conversation, types the same
last message and presses Enter; the browser is closed after the reply; then (a) again. The page's rate is set
beside the mean of the two API rates around it: the machine's speed drifts within a round too.
- short: one user message (a new session in the page).
- long: LONG_TURNS messages of text (>= 5k tokens) before that message. The API's warm-up request stores
  it as a session; each page round opens that session and branches it before its last message (the branch
  shares its stored KV), so the page shows the whole conversation and sends the same last message.
Both rates are measured as the client sees the server generate: (tokens - 1) / (seconds from the first
streamed text to the last), so the prefill is left out. The API's client times its stream chunks; the page
records, with a MutationObserver, when the reply's text last grew. Tokens are the API's
usage.completion_tokens. The page's reply is usually the same greedy reply (`same_reply`), so it has as many;
where it is not (the long case's page turn reads the conversation's KV back from its stored int8 chunks, the API
continues from the KV it holds, and a rounding apart can change a greedy choice), the page's count is its text's
tokens scaled by the API's usage over the API text's tokens (the model's own tokenizer; the scaling cancels what
re-tokenising decoded text adds or loses).
Beside each rate, the CPU (in cores) of the app's process and of the browser while the reply streamed (sampled
every 0.1 s and read over the reply's own first and last change, as each client saw them): where the time goes. The
machine's speed drifts between rounds, so the figure to quote per case is the median of the rounds' own ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from chat_service.page_turns import LIVE_PLACEHOLDER

CHROMIUM = "/usr/bin/chromium"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TEXT = Path(__file__).parent / "data" / "cat_and_racket.txt"
LONG_TURNS = 120  # messages before the prompt: 6,666 prompt tokens in all with SmolLM2
WORDS_PER_MESSAGE = 36
BOT = "#ig-chat [data-testid='bot']"
# the page's own clock: when the newest reply first showed text and when it last grew. It reads textContent,
# which needs no layout (innerText would force one at every change: the benchmark would slow what it measures).
# The page shows a reply it reads as it grows in an element of its own (`.ig-live`, ui/live_reply.py) over the
# message's placeholder: that element's text while it is there, and no change once the chat's own value has
# taken its place (after the turn's save, as the same text)
WATCH = """(count) => {
  window.__igTimes = {first: null, last: null, text: "", live: false};
  new MutationObserver(() => {
    const bots = document.querySelectorAll("%s");
    if (bots.length <= count) return;
    const bot = bots[bots.length - 1], live = bot.querySelector(".ig-live");
    if (!live && window.__igTimes.live) return;
    window.__igTimes.live = window.__igTimes.live || live !== null;
    const text = live ? live.textContent : bot.textContent;
    if (text.length && text !== %s && text !== window.__igTimes.text) {
      const now = performance.now();
      if (window.__igTimes.first === null) window.__igTimes.first = now;
      window.__igTimes.last = now;
      window.__igTimes.text = text;
    }
  }).observe(document.querySelector("#ig-chat"), {subtree: true, childList: true, characterData: true});
}""" % (BOT, json.dumps(LIVE_PLACEHOLDER))


@dataclass(frozen=True)
class Case:
    name: str
    earlier: tuple[tuple[str, str], ...]  # (role, content) before the prompt

    def messages(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.earlier] + \
            [{"role": "user", "content": PROMPT}]


def long_conversation(turns: int = LONG_TURNS) -> tuple[tuple[str, str], ...]:
    """`turns` alternating user/assistant messages cut from the bench's text at shifting places (each differs)."""
    words = TEXT.read_text().split()
    messages = []
    for number in range(turns):
        start = (number * 53) % (len(words) - WORDS_PER_MESSAGE)
        role = "user" if number % 2 == 0 else "assistant"
        messages.append((role, f"({number + 1}) " + " ".join(words[start:start + WORDS_PER_MESSAGE])))
    return tuple(messages)


CASES = {"short": Case("short", ()), "long": Case("long", long_conversation())}


class CpuClock:
    """CPU seconds of the app's process and of this process's other descendants (the browser), from /proc."""

    def __init__(self, app_pid: int) -> None:
        self.app_pid = app_pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _stat(self, pid: int) -> tuple[int, float]:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / self.tick  # ppid, utime + stime

    def cpu_seconds(self, pid: int) -> float:
        """One process's CPU seconds so far (OSError and friends once it has ended)."""
        return self._stat(pid)[1]

    def _scan(self) -> tuple[dict[int, float], list[int]]:
        """Every process's CPU seconds, and the browser's processes among them."""
        parents, cpu = {}, {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    parents[int(entry)], cpu[int(entry)] = self._stat(int(entry))
                except (OSError, ValueError, IndexError):
                    pass

        def under(pid: int, root: int) -> bool:
            while pid > 1:
                if pid == root:
                    return True
                pid = parents.get(pid, 0)
            return False

        mine = os.getpid()
        return cpu, [pid for pid in cpu if pid != mine and under(pid, mine) and not under(pid, self.app_pid)]

    def browser_pids(self) -> list[int]:
        return self._scan()[1]

    def sample(self) -> tuple[float, float]:
        """(app CPU seconds, browser CPU seconds) so far."""
        cpu, browser = self._scan()
        return cpu.get(self.app_pid, 0.0), sum(cpu[pid] for pid in browser)


class CpuTrace:
    """The app's and the browser's CPU sampled every PERIOD_S by a thread of its own while a reply streams, so
    that the CPU can be read over the reply's own window (its first and last change of text, in wall-clock time)
    afterwards, not over the time the benchmark took to notice the turn's end. The browser's processes are those
    running when the trace starts (its page is open by then); one that ends counts with what it had used."""

    PERIOD_S = 0.1

    def __init__(self, clock: CpuClock) -> None:
        self.clock = clock
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), app CPU s, browser CPU s)
        self._browser: list[int] = []
        self._seen: dict[int, float] = {}  # each process's CPU seconds when last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-trace", daemon=True)

    def __enter__(self) -> CpuTrace:
        self._browser = self.clock.browser_pids()  # one pass over /proc; each sample then reads a few files
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _seconds(self, pid: int) -> float:
        try:
            self._seen[pid] = self.clock.cpu_seconds(pid)
        except (OSError, ValueError, IndexError):  # ended: what it had used when last read
            pass
        return self._seen.get(pid, 0.0)

    def _sample(self) -> None:
        browser = sum(self._seconds(pid) for pid in self._browser)
        self.samples.append((time.time(), self._seconds(self.clock.app_pid), browser))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.PERIOD_S):
            self._sample()
        self._sample()  # the last, after the window

    def cores_between(self, start: float, end: float) -> tuple[float, float]:
        """(app, browser) cores from `start` to `end` (time.time()), the CPU at each end interpolated. The window
        must lie within the samples (ValueError otherwise: a reply timed outside its trace)."""
        if not self.samples or not self.samples[0][0] <= start <= end <= self.samples[-1][0]:
            raise ValueError(f"the window {start:.3f}-{end:.3f} is not within the CPU samples")

        def at(moment: float) -> tuple[float, float]:
            before = max(s for s in self.samples if s[0] <= moment)
            after = min(s for s in self.samples if s[0] >= moment)
            share = 0.0 if after[0] == before[0] else (moment - before[0]) / (after[0] - before[0])
            return (before[1] + share * (after[1] - before[1]), before[2] + share * (after[2] - before[2]))

        (app_start, browser_start), (app_end, browser_end) = at(start), at(end)
        seconds = max(end - start, 1e-9)
        return (app_end - app_start) / seconds, (browser_end - browser_start) / seconds


def _api_reply(url: str, case: Case, max_new_tokens: int, clock: CpuClock) -> dict:
    body = json.dumps({"messages": case.messages(), "max_tokens": max_new_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}v1/chat/completions", body, {"Content-Type": "application/json"})
    first = last = None
    text, tokens, prompt_tokens = "", 0, 0
    with CpuTrace(clock) as trace, urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    last = time.time()
                    first = first or last
                    text += choice["delta"]["content"]
    return {"tokens": tokens, "prompt_tokens": prompt_tokens, "seconds": last - first, "text": text,
            "app_cores": trace.cores_between(first, last)[0]}


def _launch(playwright):
    args = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)


def _open_case(url: str, case: Case, long_session: str | None) -> None:
    """The page's session for `case`: a new one, or a branch of the long conversation before its prompt."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    if not case.earlier:
        client.predict(api_name="/new_session")
        return
    client.predict(long_session, api_name="/open_session")
    client.predict(len(case.earlier), api_name="/branch")


def _page_reply(url: str, case: Case, long_session: str | None, playwright, clock: CpuClock) -> dict:
    _open_case(url, case, long_session)
    browser = _launch(playwright)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        page.goto(url)
        page.wait_for_selector("#ig-status:has-text('Ready')", timeout=120_000)
        shown = sum(role == "assistant" for role, _ in case.earlier)
        page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length == {shown}", timeout=120_000)
        page.evaluate(WATCH, shown)
        time.sleep(1.0)  # the page settles (its first tick) before the message is sent
        with CpuTrace(clock) as trace:
            box = page.locator("#ig-message textarea")
            box.fill(PROMPT)
            box.press("Enter")
            page.wait_for_function("window.__igTimes.first !== null", timeout=600_000, polling=100)
            # the turn is over when the status line no longer says it is generating and the text stopped growing
            while True:
                time.sleep(1.0)
                status = page.locator("#ig-status").inner_text()
                if not any(word in status for word in ("Generating", "Reading")):
                    if page.evaluate("performance.now() - window.__igTimes.last") > 3000:
                        break
            times = page.evaluate("window.__igTimes")
            origin = page.evaluate("performance.timeOrigin")  # the page's clock in ms since the epoch
        app_cores, browser_cores = trace.cores_between((origin + times["first"]) / 1000, (origin + times["last"]) / 1000)
        return {"seconds": (times["last"] - times["first"]) / 1000, "text": page.locator(BOT).last.inner_text(),
                "app_cores": app_cores, "browser_cores": browser_cores}
    finally:
        browser.close()


def reply_text(history: list[dict]) -> str:
    """The text of the reply at the end of a chat value as gradio_client gives it ("" when the last message is
    not the assistant's); a message's content is a string or Gradio's list of typed parts."""
    if not history or history[-1].get("role") != "assistant":
        return ""
    content = history[-1].get("content", "")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return content if isinstance(content, str) else ""


def _queue_reply(url: str, case: Case, long_session: str | None, clock: CpuClock) -> dict:
    """The page's turn without a browser: the same message through the page's own handler (`/send`), Gradio's
    queue and its streamed diffs, read by gradio_client; timed like the page, at each change of the reply's text.
    Set beside the browser's figure, it says whether a loss is the server's or the browser's."""
    from gradio_client import Client

    _open_case(url, case, long_session)
    first = last = None
    text = ""
    with CpuTrace(clock) as trace:
        for history, *_ in Client(url, verbose=False).submit(PROMPT, api_name="/send"):
            content = reply_text(history)
            if content and content != text:
                last, text = time.time(), content
                first = first or last
    return {"seconds": last - first, "text": text, "app_cores": trace.cores_between(first, last)[0],
            "browser_cores": 0.0}


def _set_max_new_tokens(url: str, max_new_tokens: int) -> None:
    """The page's settings: the defaults (greedy) with the reply's length capped like the API request's."""
    from gradio_client import Client

    from chat_service.settings import Settings

    s = Settings()
    Client(url, verbose=False).predict(s.policy, s.alpha, s.budget, s.partial_ratio, s.pool_limit, False, 0.0, 1.0,
                                       0, 1.0, max_new_tokens, s.min_fetch_tokens, api_name="/apply_settings")


def _long_session(url: str) -> str:
    """The id of the session the long case's warm-up request stored (the API session with the most messages)."""
    from gradio_client import Client

    sessions = Client(url, verbose=False).predict(api_name="/list_sessions")
    return max(sessions, key=lambda s: s.get("message_count", 0))["id"]


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def _page_tokens(api: dict, page: dict, count_tokens) -> int:
    """The page reply's tokens: the API's count where the replies are the same, else counted from its text."""
    if _same(api["text"], page["text"]):
        return api["tokens"]
    return round(count_tokens(page["text"]) * api["tokens"] / max(1, count_tokens(api["text"])))


def _round_row(number: int, case: Case, around: tuple[dict, dict], page: dict, count_tokens) -> dict:
    """`around`: the API's reply before the page's and the same reply after it; the page's rate is set beside
    the mean of their two rates (the machine's speed drifts within a round as well as between rounds)."""
    api = around[0]
    page_tokens = _page_tokens(api, page, count_tokens)
    api_rates = [(reply["tokens"] - 1) / reply["seconds"] for reply in around]
    row = {"round": number, "case": case.name, "prompt_tokens": api["prompt_tokens"], "tokens": api["tokens"],
           "page_tokens": page_tokens, "api_tokens_per_s": statistics.mean(api_rates),
           "api_tokens_per_s_before_after": api_rates,
           "page_tokens_per_s": (page_tokens - 1) / page["seconds"],
           "api_app_cores": statistics.mean(reply["app_cores"] for reply in around), "page_app_cores": page["app_cores"],
           "page_browser_cores": page["browser_cores"], "same_reply": _same(api["text"], page["text"]),
           "api_text": api["text"], "page_text": page["text"]}
    row["ratio"] = row["page_tokens_per_s"] / row["api_tokens_per_s"]
    return row


def _token_counter():
    """Counts a text's tokens with the default model's tokenizer (the one `python app.py` loads)."""
    from transformers import AutoTokenizer

    from infinigen_core.loading import default_cache_dir, ensure_default_gguf

    gguf = ensure_default_gguf(default_cache_dir(), progress=lambda message: None)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


HEADER = ("| round | case | prompt tokens | tokens (API / page where they differ) | API, mean of before and after (tokens/s) | page (tokens/s) | page / API | app CPU, API | "
          "app CPU, page | browser CPU | same reply |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _row_line(r: dict) -> str:
    tokens = r["tokens"] if r["page_tokens"] == r["tokens"] else f"{r['tokens']} / {r['page_tokens']}"
    return (f"| {r['round']} | {r['case']} | {r['prompt_tokens']} | {tokens} | {r['api_tokens_per_s']:.2f} | "
            f"{r['page_tokens_per_s']:.2f} | {r['ratio']:.3f} | {r['api_app_cores']:.2f} | {r['page_app_cores']:.2f} | "
            f"{r['page_browser_cores']:.2f} | {r['same_reply']} |")


def measure_rounds(max_new_tokens: int, rounds: int, cases: tuple[str, ...] = ("short", "long"),
                   show=print, browser: bool = True) -> dict:
    """`browser=False`: the page's turn goes through the page's handler and Gradio's queue without a browser
    (`_queue_reply`); the browser CPU column is then 0."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from app_server import running_app
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError("Debian chromium is not installed (apt-get install chromium)")
    chosen = [CASES[name] for name in cases]
    count_tokens = _token_counter()
    rows: list[dict] = []
    show(HEADER)
    with tempfile.TemporaryDirectory(prefix="page-bench-") as folder, running_app(Path(folder), compiled=True) as app, \
            sync_playwright() as playwright:
        clock = CpuClock(app.process.pid)
        _set_max_new_tokens(app.url, max_new_tokens)
        long_session = None
        for case in chosen:  # warm-up: first-call costs out of the measured rounds; stores the long conversation
            _api_reply(app.url, case, 8, clock)
            if case.earlier:
                long_session = _long_session(app.url)
        for number in range(1, rounds + 1):
            for case in chosen:
                before = _api_reply(app.url, case, max_new_tokens, clock)
                time.sleep(2)
                page = _page_reply(app.url, case, long_session, playwright, clock) if browser else \
                    _queue_reply(app.url, case, long_session, clock)
                time.sleep(2)
                after = _api_reply(app.url, case, max_new_tokens, clock)
                time.sleep(2)
                rows.append(_round_row(number, case, (before, after), page, count_tokens))
                show(_row_line(rows[-1]))
    summary = {}
    for case in chosen:
        mine = [r for r in rows if r["case"] == case.name]
        # the machine's speed drifts from round to round: the median of the ratios within a round is the robust figure
        summary[case.name] = {"median_round_ratio": statistics.median(r["ratio"] for r in mine),
                              "api_tokens_per_s": statistics.median(r["api_tokens_per_s"] for r in mine),
                              "page_tokens_per_s": statistics.median(r["page_tokens_per_s"] for r in mine)}
        show(f"{case.name}: median of the rounds' page/API ratios {summary[case.name]['median_round_ratio']:.3f} "
             f"(median rates: API {summary[case.name]['api_tokens_per_s']:.2f}, "
             f"page {summary[case.name]['page_tokens_per_s']:.2f} tokens/s)")
    return {"max_new_tokens": max_new_tokens, "prompt": PROMPT, "long_turns": LONG_TURNS, "browser": browser, "rows": rows,
            "summary": summary}
