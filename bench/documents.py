"""Time to the first token for a chat about an attached file: read the first time, in a second new chat about
the same file, and in a third after a restart of the app (its chunk files dropped from the page cache).

    python -m bench documents [--tokens 6000] [--text bench/data]

Starts `python app.py` on an empty data directory and sends the document as an OpenAI `file` content part (a
base64 data URL, as a client uploads it) with a question, streamed, one reply of up to 8 tokens. Then a new
conversation: the same file, another question. Then the app is stopped, the session chunks are dropped from
the page cache (read from disk, as after a reboot), the app is started again and a third new conversation
about the file is sent. The text is bench/data/cat_and_racket.txt (public domain; see its first line),
repeated to `--tokens`. Needs the `openai` package (requirements-test.txt).
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from .api import _app, _drop_from_page_cache, _first_token

DATA = Path(__file__).resolve().parent / "data"
FILENAME = "cat_and_racket.txt"
QUESTIONS = ("Where does the story take place?", "Who is the young man watching?", "What does the girl do?")


def _document(tokens: int, text_dir: Path) -> tuple[str, int]:
    """About `tokens` tokens of the folder's text (repeated when shorter) and its exact token count."""
    import torch

    from infinigen_core.loading import default_cache_dir, load_model

    from .common import repeated_token_ids

    source = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(text_dir.glob("*.txt")))
    _, tokenizer, _ = load_model(None, default_cache_dir(), torch.device("cpu"), progress=lambda message: None)
    text = tokenizer.decode(repeated_token_ids(tokenizer, source, tokens)[:tokens])
    return text, len(tokenizer(text)["input_ids"])


def _about_the_file(text: str, question: str) -> list[dict]:
    data_url = "data:text/plain;base64," + base64.b64encode(text.encode()).decode()
    return [{"role": "user", "content": [{"type": "file", "file": {"filename": FILENAME, "file_data": data_url}},
                                         {"type": "text", "text": question}]}]


def measure(tokens: int = 6000, text_dir: Path = DATA) -> dict:
    text, doc_tokens = _document(tokens, text_dir)
    with tempfile.TemporaryDirectory(prefix="documents-bench-") as folder:
        data_dir = Path(folder)
        with _app(data_dir) as url:
            first_s, _, first_prompt, first_read = _first_token(url, _about_the_file(text, QUESTIONS[0]))
            reuse_s, _, reuse_prompt, reuse_read = _first_token(url, _about_the_file(text, QUESTIONS[1]))
        _drop_from_page_cache(data_dir)
        with _app(data_dir) as url:
            cold_s, _, cold_prompt, cold_read = _first_token(url, _about_the_file(text, QUESTIONS[2]))
    return {"doc_tokens": doc_tokens, "first_prompt": first_prompt, "first_read": first_read,
            "first_ttft_s": first_s, "reuse_prompt": reuse_prompt, "reuse_read": reuse_read,
            "reuse_ttft_s": reuse_s, "cold_prompt": cold_prompt, "cold_read": cold_read, "cold_reuse_ttft_s": cold_s,
            "speedup": first_s / reuse_s, "cold_speedup": first_s / cold_s,
            "cached_tokens": reuse_prompt - reuse_read, "cold_cached_tokens": cold_prompt - cold_read}
