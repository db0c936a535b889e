"""The llama.cpp speed peer runs the flash attention settings it is asked for, per context: checked through the
real subprocess path (bench/llama_peer.py) with a stand-in llama_cpp module that records what it was made to do."""

import json
import sys

import pytest

from bench.common import EvalError
from bench.speed import flash_attn_per_context, llama_cpp_rows

FAKE_LLAMA_CPP = '''
import ctypes, json, os

__version__ = "0-fake"
VOCAB = 8


class _Context:
    def __init__(self):
        self.logits = (ctypes.c_float * VOCAB)(*range(VOCAB))

    def get_logits_ith(self, index):
        return ctypes.cast(self.logits, ctypes.POINTER(ctypes.c_float))


class Llama:
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_batch, flash_attn, logits_all, verbose):
        self.flash_attn = flash_attn
        self._ctx = _Context()
        self._record({"made": flash_attn, "n_ctx": n_ctx})

    def _record(self, event):
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
            log.write(json.dumps(event) + "\\n")

    def n_vocab(self):
        return VOCAB

    def reset(self):
        pass

    def eval(self, ids):
        if len(ids) > 1:
            self._record({"prefill": len(ids), "flash_attn": self.flash_attn})
'''


@pytest.fixture
def fake_interpreter(tmp_path):
    """An 'interpreter' that runs the real peer script with the stand-in llama_cpp first on its path."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "events.jsonl"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake'} FAKE_LLAMA_LOG={log} exec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return script, gguf, log


def events(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_each_context_runs_the_flash_attention_settings_it_names(fake_interpreter):
    script, gguf, log = fake_interpreter
    ids = list(range(100))
    rows = llama_cpp_rows(script, gguf, ids, [16, 64], decode_tokens_n=4, rounds=2, threads=1,
                          flash_attn=["both", "on"])
    prefills = [(e["prefill"], e["flash_attn"]) for e in events(log) if "prefill" in e]
    # two rounds each: the short context with both settings interleaved, the long one with flash attention only
    assert prefills == [(16, True), (16, False)] * 2 + [(64, True)] * 2
    short, long = rows
    assert set(short["ms_per_token_by_fa"]) == {"on", "off"} and set(long["ms_per_token_by_fa"]) == {"on"}
    assert long["flash_attn"] is True and long["prefill_flash_attn"] is True
    assert long["decode_steps"] == 2 * 2  # per round: 2 steps timed, the first after the prefix a warm-up
    assert all(row["peak_rss_bytes"] > 1_000_000 and row["policy"] == "llama.cpp" for row in rows)


def test_off_alone_makes_no_flash_attention_model_and_no_choice_means_both(fake_interpreter):
    script, gguf, log = fake_interpreter
    llama_cpp_rows(script, gguf, list(range(40)), [16], decode_tokens_n=2, rounds=1, flash_attn=["off"])
    assert [e["made"] for e in events(log) if "made" in e] == [False]
    log.unlink()
    llama_cpp_rows(script, gguf, list(range(40)), [16], decode_tokens_n=2, rounds=1)
    assert [e["made"] for e in events(log) if "made" in e] == [True, False]


def test_flash_attention_choices_are_checked_per_context():
    assert flash_attn_per_context(None, 2) == [["on", "off"], ["on", "off"]]
    assert flash_attn_per_context(["on"], 3) == [["on"]] * 3
    assert flash_attn_per_context(["both", "off"], 2) == [["on", "off"], ["off"]]
    with pytest.raises(EvalError, match="one per context"):
        flash_attn_per_context(["on", "off", "on"], 2)
    with pytest.raises(EvalError, match="one of both, on, off"):
        flash_attn_per_context(["fast"], 1)
