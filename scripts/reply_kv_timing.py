"""What writing a streaming reply's KV rows costs: decode speed of a long reply with the writes on and off, and
the time to first token of a 4k-token prompt with its chunk written in the background and with no chunk
written at all. The default model and engine settings, a throw-away data directory; rounds interleaved.

usage: flock /tmp/bench.lock python scripts/reply_kv_timing.py [--rounds 3] [--reply-tokens 300]
                                            [--prompt-tokens 4000] [--text FILE|FOLDER]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load_token_ids, read_text  # noqa: E402
from infinigen_core import SamplingConfig, load_engine  # noqa: E402
from sessions import ChatSession, SessionStore  # noqa: E402
from sessions.chunk_writer import SessionChunks  # noqa: E402

STORY = "Write a long story about a lighthouse keeper, his cat and the winter storms, in many chapters."
# ../shared/data/haystack beside the repository (a worktree sits one folder deeper): essays, read in name order
DEFAULT_TEXT = next((up / "shared" / "data" / "haystack" for up in Path(__file__).resolve().parents[2:4]
                     if (up / "shared" / "data" / "haystack").is_dir()), Path("haystack"))


class NoReplyStream(SessionChunks):
    """The reply's rows written at its end only (no stand-ins while it streams)."""

    def stream(self, engine) -> bool:
        return False


class NoChunks(SessionChunks):
    """The baseline without any KV chunk: nothing is exported or written."""

    def persist(self, engine, boundary=None, background=False) -> None:
        self.saved_ids = list(engine.token_ids)

    def stream(self, engine) -> bool:
        return False


@dataclass
class Turn:
    first_token_s: float  # from sending to the first token
    ms_per_token: float  # wall time per token after the first
    cpu_ms_per_token: float  # this process's CPU time per token after the first (the writes' thread included)
    tokens: int


def one_turn(store: SessionStore, engine, text: str, max_new_tokens: int, reply_kv: bool = True,
             chunks: bool = True) -> Turn:
    """One turn in a new session, timed."""
    session_id = store.create("timing")
    with ChatSession.open(store, engine, session_id) as chat:
        if not chunks:
            chat._chunks = NoChunks(store, session_id)
        elif not reply_kv:
            chat._chunks = NoReplyStream(store, session_id)
        started, first, last, tokens = time.perf_counter(), 0.0, 0.0, 0
        cpu_first = cpu_last = 0.0
        for event in chat.send(text, SamplingConfig(max_new_tokens=max_new_tokens)):
            if event.token_id is not None:
                tokens, last, cpu_last = tokens + 1, time.perf_counter(), time.process_time()
                if tokens == 1:
                    first, cpu_first = last, cpu_last
    store.delete(session_id)
    steps = max(tokens - 1, 1)
    return Turn(first - started, (last - first) * 1000 / steps, (cpu_last - cpu_first) * 1000 / steps, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    args = parser.parse_args()
    engine = load_engine(progress=lambda message: None)
    ids = load_token_ids(engine.tokenizer, read_text(args.text), args.prompt_tokens, args.text)
    long_prompt = engine.tokenizer.decode(ids[: args.prompt_tokens]) + "\n\nSummarise this in one sentence."
    with tempfile.TemporaryDirectory() as folder:
        store = SessionStore(Path(folder) / "data")
        one_turn(store, engine, STORY, 8)  # warm-up
        decode: dict[bool, list[Turn]] = {True: [], False: []}
        first: dict[bool, list[Turn]] = {True: [], False: []}
        prompt_tokens = len(engine.tokenizer.encode(long_prompt))
        for round_ in range(args.rounds):
            order = (True, False) if round_ % 2 == 0 else (False, True)
            for on in order:
                turn = one_turn(store, engine, STORY, args.reply_tokens, reply_kv=on)
                decode[on].append(turn)
                print(f"decode, reply KV {'on ' if on else 'off'}: {turn.ms_per_token:.1f} ms/token, "
                      f"CPU {turn.cpu_ms_per_token:.1f} ms/token ({turn.tokens} tokens)", flush=True)
            for on in order:
                turn = one_turn(store, engine, long_prompt, 4, chunks=on)
                first[on].append(turn)
                print(f"first token, {prompt_tokens} tokens, chunks {'on ' if on else 'off'}: "
                      f"{turn.first_token_s:.2f} s", flush=True)
    for on in (True, False):
        print(f"median decode, reply KV {'on' if on else 'off'}: "
              f"{statistics.median(t.ms_per_token for t in decode[on]):.1f} ms/token, CPU "
              f"{statistics.median(t.cpu_ms_per_token for t in decode[on]):.1f} ms/token; median first token "
              f"({prompt_tokens} tokens), chunks {'on' if on else 'off'}: "
              f"{statistics.median(t.first_token_s for t in first[on]):.2f} s")


if __name__ == "__main__":
    main()
