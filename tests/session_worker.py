"""Run by test_sessions.py in a real subprocess that the test kills with SIGKILL mid-turn.

usage: python tests/session_worker.py DATA_DIR SESSION_ID snapshot
Completes one turn and prints TURN1 DONE <tokens>, then answers a short second turn and halts inside
the chunk write (temporary file written, before fsync and rename), printing SNAPSHOT WRITING.
(A kill mid-reply is tests/crash_worker.py's.)
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infinigen_core import SamplingConfig, load_engine  # noqa: E402
from sessions import ChatSession, SessionStore  # noqa: E402

store = SessionStore(sys.argv[1])
# eager: compiling the decode step would cost this process 20-60 s, and what is tested is what reaches the disk
engine = load_engine(device="cpu", compile_decode=False, progress=lambda message: None)
chat = ChatSession.open(store, engine, sys.argv[2])
for _ in chat.send("What is the capital of France?", SamplingConfig(max_new_tokens=12)):
    pass
print("TURN1 DONE", engine.num_tokens, flush=True)


def halt_before_sync(fd: int) -> None:  # the next fsync is the chunk's: wait there to be killed
    print("SNAPSHOT WRITING", flush=True)
    time.sleep(600)


os.fsync = halt_before_sync
for _ in chat.send("And of Italy?", SamplingConfig(max_new_tokens=6)):
    pass
print("FINISHED", flush=True)
