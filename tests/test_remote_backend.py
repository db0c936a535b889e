"""The app in front of a remote OpenAI-compatible server (`python app.py --backend URL`, issue 33).

The backend is a second instance of this app (a real OpenAI-compatible server with the real default model),
one subprocess for the module, with a key. The front runs as a subprocess with `--backend` (its /v1 and its
page; one test restarts it), or in-process where only the service is under test. The test that kills the
backend runs last.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sqlite3
import threading
from pathlib import Path

import httpx
import pytest

from chat_service import ChatService, UserError
from chat_service.api_turns import ApiTurn, Conversation
from chat_service.backend_client import BackendClient, BackendConfig, BackendError
from chat_service.backend_tokens import BackendTokens
from chat_service.out_of_window import preview
from chat_service.settings import SettingsForm
from infinigen_core import SamplingConfig
from sessions import ChatSession, WindowCheck
from ui.page_text import session_choices, session_details
from ui.remote_panel import remote_view

from app_server import RunningApp, chromium_page, free_port, running_app

KEY = "backend-secret"
BOT = "#ig-chat [data-testid='bot']"
COUNTING = "Write the numbers from 1 to 300, separated by commas."  # greedy SmolLM2 goes on past 200 tokens


class Front:
    """The front app as a subprocess, which `restart` stops and starts again on the same data dir."""

    def __init__(self, data_dir: Path, args: tuple[str, ...]) -> None:
        self.data_dir, self._args, self._running = data_dir, args, contextlib.ExitStack()
        self._start()

    def _start(self) -> None:
        self.app: RunningApp = self._running.enter_context(running_app(self.data_dir, args=self._args))
        self.api = f"{self.app.url}v1"

    def restart(self) -> None:
        self._running.close()  # the process ends (SIGTERM, then its exit)
        assert self.app.process.poll() is not None
        self._start()

    def stop(self) -> None:
        self._running.close()


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # eager decoding: the backend starts in seconds instead of compiling (tests compare texts, not speed)
    with running_app(tmp_path_factory.mktemp("backend"), args=("--api-key", KEY, "--no-compile")) as app:
        yield app


@pytest.fixture(scope="module")
def front(backend, tmp_path_factory):
    front = Front(tmp_path_factory.mktemp("front"), ("--backend", f"{backend.url}v1", "--backend-key", KEY))
    yield front
    front.stop()


def backend_tokens(backend: RunningApp, messages: list[dict], for_reply: bool = True) -> dict:
    response = httpx.post(f"{backend.url}tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"messages": messages, "add_generation_prompt": for_reply})
    assert response.status_code == 200, response.text
    return response.json()


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
    # the backend's /tokenize (vLLM's shape) counts the prompt exactly as its turn read it
    asked = backend_tokens(backend, [{"role": "user", "content": COUNTING}])
    assert asked["count"] == len(asked["tokens"]) == usage["prompt_tokens"] and asked["max_model_len"] == 8192
    # the sidebar's count of the stored session is the server's count of the whole conversation
    whole = backend_tokens(backend, [{"role": "user", "content": COUNTING}, {"role": "assistant", "content": text}],
                           for_reply=False)["count"]
    assert whole != usage["prompt_tokens"] + usage["completion_tokens"]  # so the reply's usage would not give it
    assert rows(front.data_dir, "SELECT token_count FROM sessions WHERE id = ?", session) == [(whole,)]


def test_tokenize_is_behind_the_key_and_says_what_is_wrong(backend):
    url, headers = f"{backend.url}tokenize", {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url, json={"prompt": "Hello"}, timeout=30).status_code == 401
    text = httpx.post(url, json={"prompt": "Hello there"}, headers=headers, timeout=30).json()
    assert text["count"] == len(text["tokens"]) > 1
    refused = httpx.post(url, json={"prompt": "Hi", "messages": []}, headers=headers, timeout=30)
    assert refused.status_code == 400 and "either messages" in refused.json()["error"]["message"]
    wrong_model = httpx.post(url, json={"model": "gpt-4", "prompt": "Hi"}, headers=headers, timeout=30)
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    # a text no window could hold is refused as a turn's would be, without tokenizing 8 MB
    beyond = httpx.post(url, json={"prompt": "a" * 8_000_000}, headers=headers, timeout=60)
    assert beyond.status_code == 400 and beyond.json()["error"]["code"] == "context_length_exceeded"


def test_one_tokenize_request_the_server_refuses_leaves_its_counts_on_for_the_next(backend):
    tokens = BackendTokens(BackendClient(BackendConfig(f"{backend.url}v1", key=KEY)))
    try:
        assert tokens.count([{"role": "wizard", "content": "Hi"}]) is None  # a 400 for this request alone
        assert tokens.shape is None
        said = [{"role": "user", "content": "Hello there"}]
        assert tokens.count(said) == backend_tokens(backend, said)["count"] and tokens.shape == "vllm"
        assert tokens._answer(tokens.client.server_post("/no-such-endpoint", {})) is None
        assert tokens.shape == "none"  # no such endpoint: no tokenizer from now on
    finally:
        tokens.client.close()


def test_prompt_over_the_backends_window_is_refused_before_sending_and_nothing_stored(front, backend, tmp_path):
    long = " ".join(["word"] * 9000)  # as the page stores it (stripped), so both faces count the same text
    over = backend_tokens(backend, [{"role": "user", "content": long}])["count"]
    said = WindowCheck.of(over, 8192, 0).explain()  # the local engine's rule and words, with the server's count
    before, sent_before = (rows(app.data_dir, "SELECT count(*) FROM messages") for app in (front, backend))
    reply = httpx.post(f"{front.api}/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": long}], "max_tokens": 4})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["message"] == said
    assert rows(front.data_dir, "SELECT count(*) FROM messages") == before
    assert not rows(front.data_dir, "SELECT id FROM sessions WHERE origin = 'api' AND id NOT IN "
                                    "(SELECT session_id FROM messages)")
    # the page refuses it in the same words; neither face sent it (the backend would have stored its turn)
    service = remote_service(tmp_path, BackendConfig(f"{backend.url}v1", key=KEY))
    try:
        with pytest.raises(UserError) as refusal:
            list(service.page_turns.send(long))
        assert str(refusal.value) == said
        assert_nothing_stored(service)
    finally:
        service.open_sessions.close_all()
    assert rows(backend.data_dir, "SELECT count(*) FROM messages") == sent_before


def test_client_going_away_cancels_the_upstream_request(front, backend):
    asked = [{"role": "user", "content": COUNTING + " Now."}]
    response, events = stream_events(front.api, {"messages": asked, "max_tokens": 200})  # far past where it stops
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
    # the cancelled one stopped early, upstream too (half its limit: a stop takes a few decode steps to arrive)
    assert len(spans) == 2 and 0 < spans[0][0] <= 100


def test_drop_oldest_turns_counts_with_the_server_and_removes_only_stored_messages(backend, tmp_path):
    service = remote_service(tmp_path, BackendConfig(f"{backend.url}v1", key=KEY))
    try:
        session = service.open_sessions.page.id
        service.store.update(session, system_prompt="Be brief.")
        long = " ".join(["word"] * 3000)  # about 3,000 tokens: three such turns are over the 8,192 window
        service.store.add_messages(session, [(role, f"{number} {long}" if role == "user" else "Noted.", 0, 0, [])
                                             for number in range(3) for role in ("user", "assistant")])
        chat = service.open_sessions.page
        assert not chat.check_window("Next?").fits
        assert service.page_turns.drop_oldest_turns("Next?").startswith("Dropped the 1 oldest turn(s)")
        kept = service.store.messages(session)
        assert [m.content.split()[0] for m in kept if m.role == "user"] == ["1", "2"] and len(kept) == 4
        assert service.store.get(session).system_prompt == "Be brief." and chat.check_window("Next?").fits
        assert service.page_turns.drop_oldest_turns("Next?").startswith("Dropped the 0 oldest")  # it fits now
        assert remote_view(service.host).count("live on the") == 1  # the panel says where the KV lives once
    finally:
        service.open_sessions.close_all()


def test_the_overflow_setting_drops_a_remote_sessions_oldest_turns_before_sending(backend, tmp_path):
    service = remote_service(tmp_path, BackendConfig(f"{backend.url}v1", key=KEY))
    try:
        service.settings.apply(None, SettingsForm(policy="full", overflow="drop_oldest", max_new_tokens=2))
        session = service.open_sessions.page.id
        long = " ".join(["word"] * 3000)  # three such turns are over the 8,192 window (as in the test above)
        service.store.add_messages(session, [(role, f"{number} {long}" if role == "user" else "Noted.", 0, 0, [])
                                             for number in range(3) for role in ("user", "assistant")])
        assert not service.open_sessions.page.check_window("Next?").fits
        list(service.page_turns.send("Next?"))  # the oldest turn dropped, not refused by the window check
        said = [m.content.split()[0] for m in service.store.messages(session) if m.role == "user"]
        assert said == ["1", "2", "Next?"]
        assert service.page_turns.out_of_window.listed(session) == [preview(f"0 {long}")]
    finally:
        service.open_sessions.close_all()


def test_restarted_front_process_continues_the_stored_conversation(front):
    def ask_front(*turns: str) -> httpx.Response:
        roles = itertools.cycle(("user", "assistant"))
        return httpx.post(f"{front.api}/chat/completions", timeout=120, json={
            "messages": [{"role": role, "content": text} for role, text in zip(roles, turns)], "max_tokens": 6})

    first = ask_front("Say hello.")
    answer, session = first.json()["choices"][0]["message"]["content"], first.headers["x-infinigen-session"]
    front.restart()  # a new process on the same data dir: nothing of the first one's memory is left
    again = ask_front("Say hello.", answer, "Again.")
    assert again.status_code == 200
    assert again.headers["x-infinigen-session"] == session and again.headers["x-infinigen-continued"] == "true"
    stored = rows(front.data_dir, "SELECT role, content FROM messages WHERE session_id = ? ORDER BY position", session)
    assert stored[:3] == [("user", "Say hello."), ("assistant", answer), ("user", "Again.")]
    assert stored[3] == ("assistant", again.json()["choices"][0]["message"]["content"]) and len(stored) == 4
    assert not rows(front.data_dir, "SELECT * FROM chunks WHERE session_id = ?", session)  # the KV is the server's


def test_the_pages_stop_cancels_the_upstream_request_and_the_local_engine_reads_what_was_kept(backend, tmp_path,
                                                                                            real_engine):
    service = remote_service(tmp_path, BackendConfig(f"{backend.url}v1", key=KEY))
    service.settings.current.sampling = SamplingConfig(max_new_tokens=200)  # greedy: runs to 200 unless stopped
    asked = COUNTING + " Stop me."
    try:
        for history in service.page_turns.send(asked):
            if history[-1]["role"] == "assistant" and len(history[-1]["content"]) > 6:
                service.turns.stop()  # what the page's Stop button does
        session = service.open_sessions.page.id
    finally:
        service.open_sessions.close_all()
    store = service.store
    assert [m.role for m in store.messages(session)] == ["user", "assistant"]
    kept = store.messages(session)[1].content
    assert kept and store.chunks(session) == []
    # a one-token request queues behind the backend's turn: once answered, that turn has ended and been stored
    httpx.post(f"{backend.url}v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
               json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).raise_for_status()
    spans = rows(backend.data_dir, "SELECT m.token_end - m.token_start, m.content FROM messages m JOIN messages u "
                                   "ON u.session_id = m.session_id AND u.position = m.position - 1 "
                                   "WHERE m.role = 'assistant' AND u.content = ?", asked)
    assert len(spans) == 1 and 0 < spans[0][0] <= 100  # of 200: the server stopped too (a stop takes a few steps)
    assert spans[0][1].startswith(kept)
    # the sidebar: the stopped conversation as the server's tokenizer counts it (no usage came), KV the server's
    counted = backend_tokens(backend, [{"role": "user", "content": asked}, {"role": "assistant", "content": kept}],
                             for_reply=False)["count"]
    summary = next(s for s in store.list() if s.id == session)
    assert summary.token_count == counted
    assert f" · {counted:,} tok · server · " in session_choices([summary], remote=True)[0][0]
    assert "its KV cache is the server's" in session_details(summary, remote=True)
    assert "re-reads the text" in session_details(summary)  # what the local engine does with it
    # the local engine opens the remote session by reading its conversation (there are no chunks to read)
    with ChatSession.open(store, real_engine, session) as chat:
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
