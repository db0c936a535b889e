"""A saved chat's first reopen in a fresh process, as after a restart days later: seconds to open the session
(its KV read back from disk into a pool that this process has never allocated) and to the first token of a
follow-up question, then the same again in that process (a second open: memory the allocator has given back
once), and the process's resident memory after the first: anonymous (the pool, the model) and file-backed
(mapped chunk pages it touched; the kernel may drop these). `bench resume` reopens in the process that built
the chat, so its rows are the second kind.

usage: python scripts/first_open.py [--model gemma-3-270m] [--context 32768] [--text FILE|FOLDER]
                                    [--data-dir DIR] [--processes 3]

The conversation (a document from the text as its first message) is built once into --data-dir (int8 chunks,
the app's default) and reused by later runs; each of --processes fresh processes then drops the chunk from the
page cache, opens it twice and prints one JSON line. The model is loaded before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import read_text, repeated_token_ids  # noqa: E402
from bench.resume import QUESTION, evict_from_page_cache, first_token_seconds, forget_question  # noqa: E402
from infinigen_core import SamplingConfig, load_engine  # noqa: E402
from sessions import ChatSession, SessionStore, StorageConfig  # noqa: E402
from sessions.chat import REPLY_RESERVE_TOKENS  # noqa: E402

DEFAULT_TEXT = next((up / "shared" / "data" / "haystack" for up in Path(__file__).resolve().parents[2:4]
                     if (up / "shared" / "data" / "haystack").is_dir()), Path("haystack"))
BUILT = "first-open.json"  # in --data-dir: the built session's id and token count


def build(engine, data_dir: Path, context: int, text: str) -> dict:
    """The chat of `bench resume`: a document as the first message and a short reply, stored in int8 chunks."""
    store = SessionStore(data_dir, StorageConfig(kv_format="int8"))
    session_id = store.create("first open")
    target = min(context, engine.max_context - 2 * REPLY_RESERVE_TOKENS - 128)
    document = repeated_token_ids(engine.tokenizer, text, target - 120)[: target - 120]
    with ChatSession.open(store, engine, session_id) as chat:
        for _ in chat.send("Here is a document:\n\n" + engine.tokenizer.decode(document),
                           SamplingConfig(max_new_tokens=8)):
            pass
    built = {"session": session_id, "tokens": store.get(session_id).token_count}
    (data_dir / BUILT).write_text(json.dumps(built))
    return built


def resident_mb() -> dict:
    """This process's resident memory in MiB: anonymous (RSS less the file-backed and shared pages) and those."""
    memory = psutil.Process().memory_info()
    shared = getattr(memory, "shared", 0)  # Linux: file-backed and shared memory pages
    return {"rssanon_mb": round((memory.rss - shared) / 2**20), "rssfile_mb": round(shared / 2**20)}


def open_twice(engine, data_dir: Path, built: dict) -> dict:
    """Seconds to open the session and to its first new token, the first time in this process and again."""
    store = SessionStore(data_dir, StorageConfig(kv_format="int8"))
    session_id = built["session"]
    for record in store.chunks(session_id):
        evict_from_page_cache(store.data_dir / record.file)
    result = {}
    for name in ("first", "second"):
        engine.reset()
        started = time.perf_counter()
        with ChatSession.open(store, engine, session_id) as chat:
            opened = time.perf_counter() - started
            if chat.restore.rebuilt or chat.restore.tokens_prefilled > 8:
                raise SystemExit(f"the session did not restore: {chat.restore}")
            result[f"{name}_open_s"] = round(opened, 3)
            result[f"{name}_resume_s"] = round(opened + first_token_seconds(chat, QUESTION), 3)
            if name == "first":
                result.update({f"first_{key}": value for key, value in resident_mb().items()})
        forget_question(store, session_id, built["tokens"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--data-dir", type=Path, default=Path("first-open-data"))
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--open-only", action="store_true", help=argparse.SUPPRESS)  # one fresh process's part
    args = parser.parse_args()
    built_file = args.data_dir / BUILT
    if args.open_only:
        engine = load_engine(args.model, device="cpu")
        print(json.dumps(open_twice(engine, args.data_dir, json.loads(built_file.read_text()))), flush=True)
        return
    if not built_file.exists():
        args.data_dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(build(load_engine(args.model, device="cpu"), args.data_dir, args.context,
                               read_text(args.text))), flush=True)
    for _ in range(args.processes):
        subprocess.run([sys.executable, __file__, "--open-only", "--model", args.model, "--data-dir",
                        str(args.data_dir)], check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
