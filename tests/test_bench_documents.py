"""`python -m bench documents`: its flags reach the measurement and the app it starts, and a reply's ms per token
is timed from its first streamed text to its last. No app is started here (the benchmark itself does that)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import api, cli, documents


def test_the_model_and_the_reply_length_reach_the_measurement(monkeypatch, tmp_path):
    calls = []

    def measure(*args):
        calls.append(args)
        return {"doc_tokens": 20000}

    monkeypatch.setattr(documents, "measure", measure)
    monkeypatch.setattr(cli, "machine_description", lambda: "test machine")
    argv = ["documents", "--model", "gemma-3-270m", "--tokens", "20000", "--max-tokens", "24", "--text", str(tmp_path)]
    assert cli.main(argv) == 0
    assert calls == [(20000, tmp_path, "gemma-3-270m", 24)]
    assert cli.main(["documents"]) == 0 and calls[-1] == (6000, documents.DATA, None, 8)  # the defaults as before
    assert cli.main(["documents", "--max-tokens", "0"]) == 2 and len(calls) == 2


def test_the_app_is_started_with_the_model_asked_for():
    command = api.app_command(7000, Path("/data"), "gemma-3-270m")
    assert command[:2] == [sys.executable, "app.py"] and command[-2:] == ["--model", "gemma-3-270m"]
    assert "--model" not in api.app_command(7000, Path("/data"))


def chunk(text=None, usage=None):
    choices = [SimpleNamespace(delta=SimpleNamespace(content=text))] if text is not None else []
    return SimpleNamespace(choices=choices, usage=usage)


@pytest.fixture
def fake_openai(monkeypatch):
    """An OpenAI client whose stream yields three texts (read at 10.0, 10.5 and 11.3 s after a request at
    9.0 s) and then the usage: 5 reply tokens, 100 prompt tokens of which 90 came from stored KV."""
    import openai

    usage = SimpleNamespace(prompt_tokens=100, completion_tokens=5,
                            prompt_tokens_details=SimpleNamespace(cached_tokens=90))
    stream = [chunk(""), chunk("The"), chunk(" first"), chunk(" essay"), chunk(usage=usage)]
    clock = iter([9.0, 10.0, 10.5, 11.3])
    client = SimpleNamespace(models=SimpleNamespace(list=lambda: SimpleNamespace(data=[SimpleNamespace(id="m")])),
                             chat=SimpleNamespace(completions=SimpleNamespace(create=lambda **kwargs: iter(stream))))
    monkeypatch.setattr(openai, "OpenAI", lambda **kwargs: client)
    monkeypatch.setattr(api.time, "perf_counter", lambda: next(clock))


def test_a_timed_reply_counts_from_the_first_streamed_text_to_the_last(fake_openai):
    timed = api.timed_reply("http://app/v1", [{"role": "user", "content": "hi"}], max_tokens=5)
    assert timed.first_s == pytest.approx(1.0) and timed.reply == "The first essay"
    assert timed.prompt == 100 and timed.read == 10 and timed.tokens == 5
    assert timed.ms_per_token == pytest.approx(1000 * 1.3 / 4)  # 1.3 s over the 4 tokens after the first
