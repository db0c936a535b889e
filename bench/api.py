"""Time to the first token through the OpenAI-compatible API: a ~5k-token conversation read for the first
time, against the same conversation continued by one question after the app was restarted.

    python -m bench api --context 5000 [--text DIR] [--rounds 3]

Each round starts `python app.py` on an empty data directory, sends the conversation (streamed, one reply
token), stops the app, drops the saved chunks from the page cache (so they are read from disk, as after a
reboot), starts the app again and sends the conversation with the reply and a new question. It prints one
row per round: the tokens of each prompt, the tokens actually read (usage.prompt_tokens_details) and the
seconds from the request to the first streamed token. Needs the `openai` package (requirements-test.txt).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "In one sentence, what is this text about?"
FOLLOW_UP = "Give it a short title."


def _document(tokens: int, text_dir: Path | None) -> str:
    """About `tokens` tokens of prose: the files of `text_dir`, or the shipped calibration text, repeated."""
    import torch

    from infinigen_core.loading import default_cache_dir, load_model

    from .common import repeated_token_ids

    source = "\n\n".join(p.read_text() for p in sorted(text_dir.glob("*.txt"))) if text_dir else None
    _, tokenizer, _ = load_model(None, default_cache_dir(), torch.device("cpu"), progress=lambda message: None)
    return tokenizer.decode(repeated_token_ids(tokenizer, source, tokens)[:tokens])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def app_command(port: int, data_dir: Path, model: str | None = None) -> list[str]:
    """`python app.py` on `port` over `data_dir`, serving `model` (None: the default model)."""
    command = [sys.executable, "app.py", "--port", str(port), "--data-dir", str(data_dir)]
    return command + (["--model", model] if model else [])


@contextlib.contextmanager
def _app(data_dir: Path, model: str | None = None):
    port = _free_port()
    with open(data_dir / "app.log", "a") as log:
        process = subprocess.Popen(app_command(port, data_dir, model), cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 600
        while True:  # /v1/models answers 200 once the model is loaded (503 before, refused before listening)
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5):
                    break
            except OSError:
                if process.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"app.py did not start: see {data_dir / 'app.log'}") from None
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


@dataclass
class TimedReply:
    first_s: float  # seconds from the request to the first streamed text (to the stream's end for an empty reply)
    reply: str
    prompt: int  # prompt tokens
    read: int  # prompt tokens actually read (the rest came from stored KV)
    tokens: int  # reply tokens (usage.completion_tokens)
    ms_per_token: float | None  # from the first streamed text to the last, over the tokens after the first


def timed_reply(url: str, messages: list[dict], max_tokens: int = 8) -> TimedReply:
    """One streamed greedy reply of up to `max_tokens`, timed as the client sees it."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    model = client.models.list().data[0].id
    started = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    first = last = None
    reply, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter() - started
            first = first or last
            reply += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    tokens = usage.completion_tokens
    rate = 1000 * (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    first = time.perf_counter() - started if first is None else first
    return TimedReply(first, reply, usage.prompt_tokens, usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens,
                      tokens, rate)


def _drop_from_page_cache(data_dir: Path) -> None:
    from .resume import evict_from_page_cache

    for path in (data_dir / "kv").rglob("*.safetensors"):
        evict_from_page_cache(path)


def measure(context: int, text_dir: Path | None) -> dict:
    messages = [{"role": "user", "content": f"{_document(context, text_dir)}\n\n{QUESTION}"}]
    with tempfile.TemporaryDirectory(prefix="api-bench-") as folder:
        data_dir = Path(folder)
        with _app(data_dir) as url:
            first = timed_reply(url, messages)
        _drop_from_page_cache(data_dir)
        messages += [{"role": "assistant", "content": first.reply}, {"role": "user", "content": FOLLOW_UP}]
        with _app(data_dir) as url:
            again = timed_reply(url, messages)
    return {"first_prompt": first.prompt, "first_read": first.read, "first_ttft_s": first.first_s,
            "continued_prompt": again.prompt, "continued_read": again.read, "continued_ttft_s": again.first_s,
            "speedup": first.first_s / again.first_s}


COLUMNS = ("first_prompt", "first_read", "first_ttft_s", "continued_prompt", "continued_read", "continued_ttft_s",
           "speedup")


def measure_rounds(context: int, text_dir: Path | None, rounds: int, show=print) -> list[dict]:
    """`rounds` measurements; each row is shown (a Markdown table line) as soon as its round ends."""
    show("| " + " | ".join(COLUMNS) + " |")
    show("|" + "|".join("---" for _ in COLUMNS) + "|")
    rows = []
    for _ in range(rounds):
        row = measure(context, text_dir)
        show("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS) + " |")
        rows.append(row)
    return rows
