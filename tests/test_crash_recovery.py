"""A crash loses only the reply in flight: kill -9 mid-reply, reopen, and the prompt is not read again.

A real child process (tests/crash_worker.py) runs the default model; the test reopens its session here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from infinigen_core.config import SamplingConfig
from sessions import ChatSession, SessionStore

ROOT = Path(__file__).resolve().parents[1]


def kill_worker_mid_reply(data_dir: Path, session_id: str) -> tuple[int, str]:
    """Run the worker until its reply has been stored while streaming, SIGKILL it; returns (prompt tokens,
    the reply text stored at the kill)."""
    worker = subprocess.Popen([sys.executable, str(ROOT / "tests" / "crash_worker.py"), str(data_dir), session_id],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    prompt_tokens, partial = None, None
    try:
        for line in worker.stdout:
            if line.startswith("PROMPT"):
                prompt_tokens = int(line.split()[-1])
            if line.startswith("PARTIAL"):
                partial = json.loads(line.split(" ", 1)[1])
                break
        else:
            pytest.fail("the worker's reply ended before it was stored mid-stream")
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    assert prompt_tokens and partial
    return prompt_tokens, partial


def test_kill_9_mid_reply_keeps_the_prompts_kv_and_the_partial_reply(tmp_path, real_engine):
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Crash mid-reply")
    prompt_tokens, partial = kill_worker_mid_reply(store.data_dir, session_id)
    assert prompt_tokens > 200  # a prompt worth keeping: re-reading it is what the fix avoids

    reopened = SessionStore(store.data_dir)
    with ChatSession.open(reopened, real_engine, session_id) as chat:  # the dead process's lock is gone
        messages = chat.messages
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == partial  # the reply as it was stored while streaming
        # the prompt's rows came back from their own chunk; nothing was recomputed
        assert not chat.restore.rebuilt and chat.restore.tokens_restored == prompt_tokens
        assert chat.restore.tokens_prefilled == 0
        assert [(c.start, c.end) for c in reopened.chunks(session_id)] == [(0, prompt_tokens)]

        next_prompt = chat.prompt_ids("Thanks.")
        events = list(chat.send("Thanks.", SamplingConfig(max_new_tokens=4)))
        assert events[-1].finish_reason is not None
        # the next turn reads the partial reply and the new message only, not the prompt again
        assert chat.last_read_tokens == len(next_prompt) - prompt_tokens
        assert [m.role for m in chat.messages] == ["user", "assistant", "user", "assistant"]
        assert chat.messages[1].content == partial
