"""The app in front of a remote OpenAI-compatible server (`python app.py --backend URL`, issue 33).

The backend is a second instance of this app (a real OpenAI-compatible server with the real default model),
one subprocess for the module, with a key. The front runs as a subprocess with `--backend` (its /v1 and its
page), or in-process where only the service is under test. The test that kills the backend runs last.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import threading
from pathlib import Path

import httpx
import pytest

from chat_service import ChatService
from chat_service.api_turns import ApiTurn, Conversation
from chat_service.backend_client import BackendConfig, BackendError
from infinigen_core import SamplingConfig
from sessions import ChatSession

from app_server import RunningApp, chromium_page, free_port, running_app

KEY = "backend-secret"
BOT = "#ig-chat [data-testid='bot']"
COUNTING = "Write the numbers from 1 to 300, separated by commas."  # greedy SmolLM2 goes on past 200 tokens


class Front:
    """The front app as a subprocess."""

    def __init__(self, app: RunningApp) -> None:
        self.app, self.data_dir, self.api = app, app.data_dir, f"{app.url}v1"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # eager decoding: the backend starts in seconds instead of compiling (tests compare texts, not speed)
    with running_app(tmp_path_factory.mktemp("backend"), args=("--api-key", KEY, "--no-compile")) as app:
        yield app


@pytest.fixture(scope="module")
def front(backend, tmp_path_factory):
    args = ("--backend", f"{backend.url}v1", "--backend-key", KEY)
    with running_app(tmp_path_factory.mktemp("front"), args=args) as app:
        yield Front(app)


def rows(data_dir: Path, sql: str, *params) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(data_dir / "sessions.db")) as db:
        return db.execute(sql, params).fetchall()


def stream_events(url: str, body: dict, headers: dict | None = None):
    """(response, iterator of the stream's JSON events) for a streaming chat request."""
    client = httpx.Client(timeout=120)
    response = client.send(client.build_request("POST", f"{url}/chat/completions", json={**body, "stream": True},
                                                headers=headers), stream=True)

    def events():
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])

    return response, events()


def content_of(event: dict) -> str:
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in event.get("choices", ()))


# ---------------------------------------------------------------------- in-process: the client's checks
def test_backend_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="http"):
        BackendConfig("gpu-box:8000/v1")
    with pytest.raises(ValueError, match="key is empty"):
        BackendConfig("http://gpu-box:8000/v1", key=" ")


def remote_service(tmp_path: Path, config: BackendConfig) -> ChatService:
    service = ChatService(tmp_path, backend=config)
    service.load(progress=lambda message: None)
    return service


def ask(service: ChatService, *turns: str, turn: ApiTurn | None = None) -> str:
    """The reply to user and assistant turns, in turn, through the service's API turn."""
    roles = ("user", "assistant")
    asked = Conversation("", tuple((roles[i % 2], text) for i, text in enumerate(turns)),
                         SamplingConfig(max_new_tokens=6))
    return list(service.api.answer(asked, [], threading.Event(), turn or ApiTurn(), 4))[-1].full_text


def assert_nothing_stored(service: ChatService) -> None:
    """The page's open session stays empty and no API session is left behind."""
    assert [s.origin for s in service.store.list()] == ["app"]
    assert service.store.list()[0].message_count == 0


@pytest.mark.parametrize("problem", ["unreachable", "wrong key", "wrong model"])
def test_backend_refusal_is_said_and_stores_nothing(problem, backend, tmp_path):
    config = {"unreachable": BackendConfig(f"http://127.0.0.1:{free_port()}/v1", connect_timeout_s=2),
              "wrong key": BackendConfig(f"{backend.url}v1", key="not-the-key"),
              "wrong model": BackendConfig(f"{backend.url}v1", key=KEY, model="no-such-model")}[problem]
    expected = {"unreachable": "Cannot reach the backend", "wrong key": "refused the key",
                "wrong model": "no model 'no-such-model'"}[problem]
    service = remote_service(tmp_path, config)
    try:
        assert expected in service.host.status  # the status line says it from the start
        with pytest.raises(BackendError, match=expected):
            ask(service, "Hello")
        with pytest.raises(BackendError, match=expected):  # the page's turn too
            list(service.page_turns.send("Hello"))
        assert_nothing_stored(service)
    finally:
        service.open_sessions.close_all()


# ---------------------------------------------------------------------- the front app, through its API
def test_front_streams_a_reply_from_the_backend_and_stores_it_here(front, backend):
    response, events = stream_events(front.api, {"messages": [{"role": "user", "content": COUNTING}],
                                                 "max_tokens": 12, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    received = list(events)
    pieces = [content_of(event) for event in received if content_of(event)]
    assert len(pieces) > 3  # streamed, not one block
    assert received[0]["model"] == "SmolLM2-135M-Instruct"  # the backend's model, read from its /v1/models
    usage = received[-1]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 20  # the backend's own counts
    text = "".join(pieces)
    session = response.headers["x-infinigen-session"]
    assert rows(front.data_dir, "SELECT role, content FROM messages WHERE session_id = ? ORDER BY position",
                session) == [("user", COUNTING), ("assistant", text)]
    assert not (front.data_dir / "kv").exists() or not any((front.data_dir / "kv").rglob("*.*"))  # KV is remote
    # the backend answered that very reply (it stores its own API sessions)
    assert ("assistant", text) in rows(backend.data_dir, "SELECT role, content FROM messages")


def test_prompt_over_the_backends_window_is_refused_and_nothing_stored(front):
    before = rows(front.data_dir, "SELECT count(*) FROM messages")
    reply = httpx.post(f"{front.api}/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 4})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and "window" in error["message"]
    assert rows(front.data_dir, "SELECT count(*) FROM messages") == before
    assert not rows(front.data_dir, "SELECT id FROM sessions WHERE origin = 'api' AND id NOT IN "
                                    "(SELECT session_id FROM messages)")


def test_client_going_away_cancels_the_upstream_request(front, backend):
    asked = [{"role": "user", "content": COUNTING + " Now."}]
    response, events = stream_events(front.api, {"messages": asked, "max_tokens": 48})
    received = ""
    for event in events:
        received += content_of(event)
        if len(received) > 6:
            break
    response.close()  # the client goes away mid-reply
    # the same request, not cancelled, straight to the backend (queued behind the first: it ends after it)
    whole = httpx.post(f"{backend.url}v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"messages": asked, "max_tokens": 48}).json()
    assert whole["usage"]["completion_tokens"] == 48  # uncancelled, this reply runs to its limit
    spans = rows(backend.data_dir, "SELECT m.token_end - m.token_start FROM messages m JOIN messages u "
                                   "ON u.session_id = m.session_id AND u.position = m.position - 1 "
                                   "WHERE m.role = 'assistant' AND u.content = ? ORDER BY m.id", asked[0]["content"])
    assert len(spans) == 2 and 0 < spans[0][0] <= 24  # the cancelled one stopped early, upstream too


def test_restarted_front_continues_the_stored_conversation_and_the_local_engine_reads_it(backend, tmp_path,
                                                                                          real_engine):
    config = BackendConfig(f"{backend.url}v1", key=KEY)
    first, turn = remote_service(tmp_path, config), ApiTurn()
    answer = ask(first, "Say hello.", turn=turn)
    first.open_sessions.close_all()  # the process ends: its sessions' locks go
    again, restarted = ApiTurn(), remote_service(tmp_path, config)
    try:
        ask(restarted, "Say hello.", answer, "Again.", turn=again)
    finally:
        restarted.open_sessions.close_all()
    assert again.session_id == turn.session_id and again.continued
    store = restarted.store
    assert [m.role for m in store.messages(turn.session_id)] == ["user", "assistant", "user", "assistant"]
    assert store.chunks(turn.session_id) == []  # the KV is the server's
    # the local engine opens the remote session by reading its conversation
    with ChatSession.open(store, real_engine, turn.session_id) as chat:
        assert chat.restore.rebuilt and chat.restore.tokens_prefilled == real_engine.num_tokens > 20
        assert real_engine.token_ids == chat._conversation_ids()


def test_page_names_the_backend_streams_a_reply_and_shows_the_remote_figures(front, backend):
    from gradio_client import Client

    # the page's sampling settings go to the server: a 40-token reply, counted by the server
    Client(front.app.url, verbose=False).predict("infinigen", 5, "0.2", 0.25, "", False, 0.0, 1.0, 0, 1.0, 40,
                                                 api_name="/apply_settings")
    with chromium_page(front.app.url, 1400, 1300) as page:
        page.wait_for_selector(f"#ig-status:has-text('on the backend {backend.url}v1')", timeout=60_000)
        assert page.locator("#ig-remote").is_visible() and not page.locator("#ig-memory").is_visible()
        page.locator("#ig-message textarea").fill(COUNTING)
        page.locator("#ig-message textarea").press("Enter")
        lengths = []
        page.wait_for_function(f"document.querySelectorAll(\"{BOT}\").length > 0", timeout=120_000)
        while not re.search(r"reply tokens\s+40\b", page.locator("#ig-remote").inner_text()):
            lengths.append(len(page.locator(BOT).last.inner_text()))
            page.wait_for_timeout(100)
            assert len(lengths) < 1500, "the remote panel never showed the reply's figures"
        assert len({length for length in lengths if length}) > 1  # the reply grew on the page: it streamed
        panel = page.locator("#ig-remote").inner_text()
        assert "time to first token" in panel and "live on the server" in panel
        reply = page.locator(BOT).last.inner_text()
    stored = rows(front.data_dir, "SELECT content FROM messages WHERE role = 'assistant' ORDER BY id DESC LIMIT 1")
    assert stored[0][0].strip() == reply.strip()


def test_backend_killed_mid_reply_gives_a_clear_error_and_keeps_the_streamed_part(front, backend):
    """Runs last: it kills the module's backend."""
    response, events = stream_events(front.api, {"messages": [{"role": "user", "content": COUNTING + " Go."}],
                                                 "max_tokens": 200})
    received, error = "", None
    for event in events:
        if "error" in event:
            error = event["error"]
            break
        received += content_of(event)
        if len(received) > 6 and backend.process.poll() is None:
            backend.process.kill()
    assert error is not None and "stopped mid-reply" in error["message"]
    session = response.headers["x-infinigen-session"]
    stored = rows(front.data_dir, "SELECT role, content FROM messages WHERE session_id = ? ORDER BY position",
                  session)
    assert stored[0] == ("user", COUNTING + " Go.")
    assert stored[1][0] == "assistant" and stored[1][1].startswith(received) and received
