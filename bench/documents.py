"""Time to the first token for a chat about an attached file: read the first time, a follow-up question in the
same chat, a second new chat about the same file, and a third after a restart of the app (its chunk files
dropped from the page cache).

    python -m bench documents [--tokens 6000] [--text bench/data] [--model NAME] [--max-tokens 8]

Starts `python app.py` (with `--model`, where given) on an empty data directory and sends the document as an
OpenAI `file` content part (a base64 data URL, as a client uploads it) with a question, streamed, one greedy
reply of up to `--max-tokens`. Then the same conversation with that reply and a follow-up question (the API
continues the stored chat: only the new message is read). Then a new conversation: the same file, another
question. Then the app is stopped, the session chunks are dropped from the page cache (read from disk, as
after a reboot), the app is started again and a third new conversation about the file is sent. Each reply's
ms per token is timed from its first streamed text to its last. The text is bench/data/cat_and_racket.txt
(public domain; see its first line), or the `.txt` files of `--text` concatenated in name order, repeated to
`--tokens` of the model's tokenizer. Needs the `openai` package (requirements-test.txt).
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from .api import TimedReply, _app, _drop_from_page_cache, timed_reply

DATA = Path(__file__).resolve().parent / "data"
FILENAME = "cat_and_racket.txt"
QUESTIONS = ("Where does the story take place?", "Who is the young man watching?", "What does the girl do?")
# for another text (--text): questions any prose answers
OTHER_QUESTIONS = ("What is this text about?", "Which examples does the author give?", "What does the author advise?")
FOLLOW_UP = "Say that again in fewer words."


def _document(tokens: int, text_dir: Path, model: str | None = None) -> tuple[str, int]:
    """About `tokens` tokens of the folder's text (repeated when shorter) and its exact token count."""
    import torch

    from infinigen_core.loading import default_cache_dir, load_model

    from .common import repeated_token_ids

    source = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(text_dir.glob("*.txt")))
    _, tokenizer, _ = load_model(model, default_cache_dir(), torch.device("cpu"), progress=lambda message: None)
    text = tokenizer.decode(repeated_token_ids(tokenizer, source, tokens)[:tokens])
    return text, len(tokenizer(text)["input_ids"])


def _about_the_file(text: str, question: str, filename: str = FILENAME) -> list[dict]:
    data_url = "data:text/plain;base64," + base64.b64encode(text.encode()).decode()
    return [{"role": "user", "content": [{"type": "file", "file": {"filename": filename, "file_data": data_url}},
                                         {"type": "text", "text": question}]}]


def _figures(name: str, timed: TimedReply) -> dict:
    return {f"{name}_prompt": timed.prompt, f"{name}_read": timed.read, f"{name}_ttft_s": timed.first_s,
            f"{name}_ms_per_token": timed.ms_per_token}


def measure(tokens: int = 6000, text_dir: Path = DATA, model: str | None = None, max_tokens: int = 8) -> dict:
    text, doc_tokens = _document(tokens, text_dir, model)
    questions, filename = (QUESTIONS, FILENAME) if text_dir == DATA else (OTHER_QUESTIONS, f"{text_dir.name}.txt")
    with tempfile.TemporaryDirectory(prefix="documents-bench-") as folder:
        data_dir = Path(folder)
        with _app(data_dir, model) as url:
            asked = _about_the_file(text, questions[0], filename)
            first = timed_reply(url, asked, max_tokens)
            follow = timed_reply(url, asked + [{"role": "assistant", "content": first.reply},
                                               {"role": "user", "content": FOLLOW_UP}], max_tokens)
            reuse = timed_reply(url, _about_the_file(text, questions[1], filename), max_tokens)
        _drop_from_page_cache(data_dir)
        with _app(data_dir, model) as url:
            cold = timed_reply(url, _about_the_file(text, questions[2], filename), max_tokens)
    row = {"doc_tokens": doc_tokens, **_figures("first", first), **_figures("follow", follow),
           **_figures("reuse", reuse), **_figures("cold", cold)}
    row["cold_reuse_ttft_s"] = row.pop("cold_ttft_s")  # the name earlier rows used
    return {**row, "speedup": first.first_s / reuse.first_s, "follow_speedup": first.first_s / follow.first_s,
            "cold_speedup": first.first_s / cold.first_s, "cached_tokens": reuse.prompt - reuse.read,
            "follow_cached_tokens": follow.prompt - follow.read, "cold_cached_tokens": cold.prompt - cold.read}
