"""The llama.cpp speed peer runs the flash attention settings it is asked for, per context: checked through the
real subprocess path (bench/llama_peer.py) with a stand-in llama_cpp module that records what it was made to do."""

import json
import resource
import sys

import pytest

from bench.common import EvalError
from bench.speed import flash_attn_per_context, llama_cpp_rows

FAKE_LLAMA_CPP = '''
import ctypes, json, os

__version__ = "0-fake"
VOCAB = 8


class _Context:
    def __init__(self, owner):
        self.owner = owner
        self.logits = (ctypes.c_float * VOCAB)(*range(VOCAB))

    def get_logits_ith(self, index):
        return ctypes.cast(self.logits, ctypes.POINTER(ctypes.c_float))

    def kv_cache_seq_rm(self, seq_id, p0, p1):
        dropped = "FAKE_NO_SEQ_RM" not in os.environ  # a recurrent model's cache cannot drop a part
        self.owner._record({"drop_from": p0, "cached": self.owner.n_tokens, "dropped": dropped})
        return dropped


class Llama:
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_batch, flash_attn, logits_all, verbose):
        self.flash_attn = flash_attn
        self.n_tokens = 0
        self._ctx = _Context(self)
        self._record({"made": flash_attn, "n_ctx": n_ctx})

    def _record(self, event):
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
            log.write(json.dumps(event) + "\\n")

    def n_vocab(self):
        return VOCAB

    def reset(self):
        self.n_tokens = 0

    def eval(self, ids):
        if len(ids) > 1:
            self._record({"prefill": len(ids), "at": self.n_tokens, "flash_attn": self.flash_attn})
        self.n_tokens += len(ids)
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
    prefills = [(e["prefill"], e["at"], e["flash_attn"]) for e in events(log) if "prefill" in e]
    # once per context and setting, from an empty cache, as our rows prefill once per context: the short context
    # with both settings, the long one with flash attention only
    assert prefills == [(16, 0, True), (16, 0, False), (64, 0, True)]
    # each later round starts from the prefix again: the cache drops the 3 tokens the round before evaluated
    drops = [(e["drop_from"], e["cached"]) for e in events(log) if "drop_from" in e]
    assert drops == [(16, 19), (16, 19), (64, 67)]
    short, long = rows
    assert set(short["ms_per_token_by_fa"]) == {"on", "off"} and set(long["ms_per_token_by_fa"]) == {"on"}
    assert long["flash_attn"] is True and long["prefill_flash_attn"] is True
    assert long["decode_steps"] == 2 * 2  # per round: 2 steps timed, the first after the prefix a warm-up
    assert all(row["peak_rss_bytes"] > 1_000_000 and row["policy"] == "llama.cpp" for row in rows)
    # the peer's own memory, not what Linux carries over from the larger process that started it (this one)
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert ours > 300_000_000 and all(row["peak_rss_bytes"] < 150_000_000 for row in rows)


def test_a_cache_that_cannot_drop_a_part_evaluates_the_prefix_again(fake_interpreter, monkeypatch):
    script, gguf, log = fake_interpreter
    monkeypatch.setenv("FAKE_NO_SEQ_RM", "1")
    rows = llama_cpp_rows(script, gguf, list(range(40)), [16], decode_tokens_n=4, rounds=2, flash_attn=["on"])
    assert [(e["prefill"], e["at"]) for e in events(log) if "prefill" in e] == [(16, 0), (16, 0)]
    assert rows[0]["decode_steps"] == 2 * 2 and rows[0]["prefill_s"] >= 0  # 2 rounds of 2 timed steps


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
