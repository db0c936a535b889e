"""Issue 34's crash row at its size: kill -9 mid-reply to a 4k-token prompt, reopen, and say what the next turn
reads.

The same worker and kill as tests/test_crash_recovery.py (the default model, eager; killed once more than 150
reply tokens have streamed and their KV rows are registered), with the prompt's notes repeated NOTES_REPEATS
times (160: 4,045 tokens) instead of the test's 12. Then, in this process: the session reopened (what
came back from chunks, what was recomputed), the partial reply stored, and the tokens the next turn reads.

usage: python scripts/crash_rerun.py [--repeats 160] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_crash_recovery import kill_worker_mid_reply  # noqa: E402  the test's own worker and kill

from infinigen_core import SamplingConfig, load_engine  # noqa: E402
from sessions import ChatSession, SessionStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=160)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="crash-rerun-"))
    print(f"load at start: {os.getloadavg()}; workdir {workdir}", flush=True)
    store = SessionStore(workdir / "data")
    session_id = store.create("Crash mid-reply at 4k")
    started = time.monotonic()
    prompt_tokens, partial = kill_worker_mid_reply(store.data_dir, session_id, args.repeats)
    print(f"killed after {time.monotonic() - started:.0f} s: prompt {prompt_tokens} tokens, "
          f"reply stored {len(partial)} characters", flush=True)

    engine = load_engine(device="cpu", compile_decode=False, progress=lambda message: None)
    reopened = SessionStore(store.data_dir)
    spans = [(c.start, c.end) for c in reopened.chunks(session_id)]
    with ChatSession.open(reopened, engine, session_id) as chat:
        reply = chat.messages[-1]
        restore = chat.restore
        print(f"chunks on disk: {spans}")
        print(f"messages: {[m.role for m in chat.messages]}; the partial reply stored: "
              f"{reply.role == 'assistant' and reply.content == partial} (tokens {reply.token_start}-"
              f"{reply.token_end})")
        print(f"reopened: {restore.tokens_restored} tokens from chunks, {restore.tokens_prefilled} recomputed, "
              f"rebuilt {restore.rebuilt}")
        next_prompt = len(chat.prompt_ids("Thanks."))
        list(chat.send("Thanks.", SamplingConfig(max_new_tokens=4)))
        print(f"the next turn: a {next_prompt}-token prompt, {chat.last_read_tokens} tokens read")
    engine.close()
    print(f"load at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
