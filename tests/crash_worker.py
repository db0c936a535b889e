"""Run by test_crash_recovery.py in a real subprocess that the test kills with SIGKILL mid-reply.

usage: python tests/crash_worker.py DATA_DIR SESSION_ID [NOTES_REPEATS]
Sends one long-ish message (its notes repeated NOTES_REPEATS times, 12 unless given: 345 tokens; 160 make
issue 34's 4k-token prompt, 4,045 tokens, for scripts/crash_rerun.py) and prints PROMPT <tokens>. While the
reply streams it watches the database; once more than REPLY_TOKENS of the reply have streamed and their KV
rows, written in the background while it streams, are registered beyond the prompt's chunk, it prints
PARTIAL <the stored text as JSON> and waits, inside the turn, to be killed. Re-reading that much reply would cost more than the 100 tokens the test allows.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infinigen_core import SamplingConfig, load_engine  # noqa: E402
from sessions import ChatSession, SessionStore  # noqa: E402

NOTES = ("The keeper of the northern light kept a log of every ship, every storm and every gull that "
         "nested on the gallery rail. ")
REPLY_TOKENS = 150

store = SessionStore(sys.argv[1])
session_id = sys.argv[2]
MESSAGE = "My notes:\n" + NOTES * int(sys.argv[3] if len(sys.argv) > 3 else 12) + \
    "\nWrite a very long story about this lighthouse."
# eager: compiling the decode step would cost this process 20-60 s; the KV rows written are the same either way
engine = load_engine(device="cpu", compile_decode=False, progress=lambda message: None)
chat = ChatSession.open(store, engine, session_id)
prompt_tokens = len(chat.prompt_ids(MESSAGE))
print("PROMPT", prompt_tokens, flush=True)
for streamed, event in enumerate(chat.send(MESSAGE, SamplingConfig(max_new_tokens=800)), start=1):
    chunks = store.chunks(session_id)
    if streamed > REPLY_TOKENS and chunks and chunks[-1].end > prompt_tokens + REPLY_TOKENS:
        print("PARTIAL", json.dumps(store.messages(session_id)[-1].content), flush=True)
        time.sleep(600)  # mid-reply, the generator suspended: the test kills us here
print("FINISHED", streamed, flush=True)
