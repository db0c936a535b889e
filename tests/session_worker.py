"""Run by test_sessions.py in a real subprocess that the test kills with SIGKILL mid-turn.

usage: python tests/session_worker.py DATA_DIR SESSION_ID
Completes one turn, prints TURN1 DONE, then starts a long second turn, printing TOKEN per token.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infinigen_core.config import SamplingConfig  # noqa: E402
from infinigen_core.loading import load_engine  # noqa: E402
from sessions import ChatSession, SessionStore  # noqa: E402

store = SessionStore(sys.argv[1])
engine = load_engine(device="cpu", progress=lambda message: None)
chat = ChatSession.open(store, engine, sys.argv[2])
for _ in chat.send("What is the capital of France?", SamplingConfig(max_new_tokens=12)):
    pass
print("TURN1 DONE", engine.num_tokens, flush=True)
for _ in chat.send("Write a very long story about a lighthouse.", SamplingConfig(max_new_tokens=400)):
    print("TOKEN", flush=True)
print("FINISHED", flush=True)
