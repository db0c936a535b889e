"""Check the app against an OpenAI-compatible server (vLLM, llama.cpp's server, another app) by hand.

    python scripts/remote_check.py --backend http://127.0.0.1:8080/v1 [--backend-key KEY] [--backend-model NAME]

It builds the app's service in-process with that backend and a throw-away data dir, then: streams a reply
through the API's turn (and counts its prompt with the server's tokenizer, where it serves one) and one
through the page's, continues the first conversation, stops a reply after a few pieces, sends a prompt over
an 8k window, and asks for a model the server does not have. It prints what each gave (the figures the
server reported included) and exits 1 when one did not behave as the app promises.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chat_service import ChatService, UserError  # noqa: E402
from chat_service.api_turns import ApiTurn, Conversation  # noqa: E402
from chat_service.backend_client import BackendConfig  # noqa: E402
from chat_service.remote_host import RemoteHost  # noqa: E402
from infinigen_core import SamplingConfig  # noqa: E402

COUNTING = "Write the numbers from 1 to 300, separated by commas."


def ask(service: ChatService, turns: tuple[tuple[str, str], ...], tokens: int, cancel_after: int = 0):
    cancel, turn, text, pieces = threading.Event(), ApiTurn(), "", 0
    asked = Conversation("", turns, SamplingConfig(max_new_tokens=tokens))
    for event in service.api.answer(asked, [], cancel, turn, 4):
        text, pieces = event.full_text, pieces + bool(event.text)
        if cancel_after and pieces >= cancel_after:
            cancel.set()
    return text, turn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--backend-key", default=None)
    parser.add_argument("--backend-model", default=None)
    args = parser.parse_args()
    config = BackendConfig(args.backend, args.backend_key, args.backend_model)
    failures = []
    with tempfile.TemporaryDirectory() as data_dir:
        service = ChatService(data_dir, backend=config)
        service.load(progress=print)
        print("model:", service.host.model_summary())
        text, turn = ask(service, (("user", "What is the capital of France?"),), 24)
        print(f"API turn: {text!r}\n  figures: {turn.figures}")
        host = service.host
        assert isinstance(host, RemoteHost)
        counted = host.tokens.count([{"role": "user", "content": "What is the capital of France?"}])
        usage = turn.figures.prompt_tokens if turn.figures else None
        print(f"the server's tokenizer: {host.tokens.shape}; it counts that prompt {counted} (its usage: {usage})")
        failures += [] if counted is None or usage is None or counted == usage else ["count differs from usage"]
        again, second = ask(service, (("user", "What is the capital of France?"), ("assistant", text),
                                      ("user", "And of Italy?")), 24)
        print(f"continued ({second.continued}, same session {second.session_id == turn.session_id}): {again!r}")
        failures += [] if second.continued and second.session_id == turn.session_id else ["not continued"]
        page = list(service.page_turns.send("Say hello."))[-1]
        print(f"page turn: {page[-1]['content']!r}")
        stopped, _ = ask(service, (("user", COUNTING),), 200, cancel_after=4)
        stored = [m.content for m in service.store.messages(service.open_sessions.api.id)] if service.open_sessions.api else []
        print(f"stopped after 4 pieces: {stopped!r}; stored: {stored[-1]!r}")
        failures += [] if stored and stored[-1] == stopped and len(stopped) < 100 else ["stop"]
        before = len(service.store.list())
        try:
            ask(service, (("user", "word " * 9000),), 4)
            failures.append("a prompt over an 8k window was not refused")
        except UserError as error:
            print(f"over the window: {error}")
        failures += [] if len(service.store.list()) == before else ["a refused prompt left a session"]
        service.open_sessions.close_all()
        wrong = ChatService(Path(data_dir) / "wrong", backend=BackendConfig(args.backend, args.backend_key,
                                                                            "no-such-model"))
        wrong.load(progress=lambda message: None)
        try:
            ask(wrong, (("user", "Hi"),), 4)
            failures.append("a wrong model was not refused")
        except UserError as error:
            print(f"wrong model: {error}")
        wrong.open_sessions.close_all()
    print("FAILED: " + ", ".join(failures) if failures else "all checks behaved")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
