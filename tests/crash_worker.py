"""Run by test_crash_recovery.py in a real subprocess that the test kills with SIGKILL mid-reply.

usage: python tests/crash_worker.py DATA_DIR SESSION_ID
Sends one long-ish message and prints PROMPT <tokens>. While the reply streams it watches the database; once
the stored reply has been updated after its first save (so it is stored as it streams, not only once) and the
prompt's chunk, written in the background, is registered, it prints PARTIAL <the stored text as JSON> and
waits, inside the turn, to be killed.
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
MESSAGE = "My notes:\n" + NOTES * 12 + "\nWrite a very long story about this lighthouse."

store = SessionStore(sys.argv[1])
session_id = sys.argv[2]
# eager: compiling the decode step would cost this process 20-60 s, and what is tested is what reaches the disk
engine = load_engine(device="cpu", compile_decode=False, progress=lambda message: None)
chat = ChatSession.open(store, engine, session_id)
print("PROMPT", len(chat.prompt_ids(MESSAGE)), flush=True)
first_saved = None
for event in chat.send(MESSAGE, SamplingConfig(max_new_tokens=400)):
    last = store.messages(session_id)[-1]
    if last.role != "assistant":
        continue
    if first_saved is None:
        first_saved = last.content
    elif last.content != first_saved and store.chunks(session_id):
        print("PARTIAL", json.dumps(last.content), flush=True)
        time.sleep(600)  # mid-reply, the generator suspended: the test kills us here
print("FINISHED", flush=True)
