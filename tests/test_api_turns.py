"""The API's answers under load and while starting, in-process (the real engine, no server process):
503 while the model loads, one turn at a time with a bounded queue and 429 beyond it."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from chat_service import ChatService
from chat_service.settings import SettingsForm
from sessions.chat import REPLY_RESERVE_TOKENS
from ui.api import ApiOptions, api_routes

HELLO = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def api_client(controller: ChatService, **options) -> TestClient:
    return TestClient(FastAPI(routes=api_routes(controller, ApiOptions(**options))))


@pytest.fixture
def loaded(tmp_path, real_engine):
    controller = ChatService(tmp_path, loader=lambda *args, **kwargs: real_engine)
    controller.load(progress=lambda message: None)
    assert controller.host.load_error is None, controller.host.load_error
    yield controller
    for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
        chat.close()


def test_requests_while_the_model_loads_get_503_with_retry_after(tmp_path):
    controller = ChatService(tmp_path)  # never loaded: still starting
    client = api_client(controller)
    for response in (client.get("/v1/models"), client.post("/v1/chat/completions", json=HELLO)):
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert response.json()["error"]["code"] == "model_loading"


def test_a_model_that_failed_to_load_says_why(tmp_path):
    def broken_loader(*args, **kwargs):
        raise OSError("no such checkpoint: /nowhere")

    controller = ChatService(tmp_path, loader=broken_loader)
    controller.load(progress=lambda message: None)
    response = api_client(controller).post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 503 and "no such checkpoint" in response.json()["error"]["message"]
    assert "retry-after" not in response.headers  # retrying will not help


def test_past_the_queue_bound_a_request_gets_429_and_stores_nothing(loaded):
    client = api_client(loaded, max_waiting=0)
    sessions_before = len(loaded.store.list())
    with loaded.turns.exclusive():  # a reply is being generated (the page's, here)
        response = client.post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert len(loaded.store.list()) == sessions_before
    assert client.post("/v1/chat/completions", json=HELLO).status_code == 200  # free again: answered


def test_requests_wait_their_turn_within_the_bound(loaded):
    client = api_client(loaded, max_waiting=1)
    answers = []
    with loaded.turns.exclusive():
        waiting = threading.Thread(target=lambda: answers.append(client.post("/v1/chat/completions", json=HELLO)))
        waiting.start()
        while loaded.turns.waiting == 0:  # the first request is queued behind the turn in progress
            time.sleep(0.01)
        second = client.post("/v1/chat/completions", json=HELLO)
        assert second.status_code == 429 and not answers  # one waits, the next is turned away
    waiting.join(timeout=120)
    assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["message"]["content"]


def threads_running(engine, monkeypatch) -> set[str]:
    """The names of the threads that run the engine's forward steps and KV restores from now on."""
    names: set[str] = set()
    for method in ("_forward", "import_rows"):
        def recorded(*args, _original=getattr(engine, method), **kwargs):
            names.add(threading.current_thread().name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(engine, method, recorded)
    return names


def test_the_page_and_the_api_take_turns_with_the_engine(loaded, monkeypatch):
    """An API turn leaves the page's session as it was; the page's next turn reads its KV back from disk. Every
    step and restore runs in the one model thread, whichever thread asked (engine_thread.py says why)."""
    ran_in = threads_running(loaded.host.engine, monkeypatch)
    client = api_client(loaded)
    loaded.settings.apply(loaded.host.engine, SettingsForm(max_new_tokens=8))  # short page replies
    page_reply = list(loaded.page_turns.send("Name a colour."))[-1]
    page_session = loaded.open_sessions.page.id
    api = client.post("/v1/chat/completions", json=HELLO)
    assert api.status_code == 200 and api.headers["x-infinigen-session"] != page_session
    assert loaded.open_sessions.page.id == page_session and loaded.pages.chat_history() == page_reply
    history = list(loaded.page_turns.send("And another one."))[-1]
    assert [m["role"] for m in history] == ["user", "assistant"] * 2
    assert loaded.open_sessions.page.restore.tokens_restored > 0 and not loaded.open_sessions.page.restore.rebuilt  # read back, not recomputed
    assert ran_in == {"model"}


def test_the_pages_stop_button_does_not_turn_away_a_request_waiting_for_its_turn(loaded):
    client = api_client(loaded, max_waiting=1)
    answers = []
    with loaded.turns.exclusive():  # the page's turn is running
        waiting = threading.Thread(target=lambda: answers.append(client.post("/v1/chat/completions", json=HELLO)))
        waiting.start()
        while loaded.turns.waiting == 0:
            time.sleep(0.01)
        loaded.turns.cancel.set()  # the user stops the page's own reply
        time.sleep(0.5)  # the waiting request sees the flag several times
    waiting.join(timeout=120)
    assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["message"]["content"]


def test_switching_models_closes_the_apis_session_too(tmp_path, real_engine):
    """Every open session holds the old engine: after a switch none is kept, so the API's next request
    reopens its conversation in the new engine (here another engine over the same model) and continues it."""
    from infinigen_core.engine import InfiniGenEngine

    def loader(model, device, config, quantize, progress):  # a fresh engine per load; closing it spares the shared one
        engine = InfiniGenEngine(real_engine.model, real_engine.tokenizer, config, skew_set=real_engine.skew_set,
                                 fingerprint=real_engine.fingerprint)
        engine.model_name = model or "SmolLM2-135M-Instruct"
        return engine

    controller = ChatService(tmp_path, loader=loader)
    controller.load(progress=lambda message: None)
    try:
        client = api_client(controller)
        first = client.post("/v1/chat/completions", json=HELLO)
        api_session = first.headers["x-infinigen-session"]
        assert controller.open_sessions.api is not None
        old_engine = controller.host.engine
        controller.switch_model("another")
        assert controller.host.engine is not old_engine and controller.open_sessions.api is None
        assert controller.open_sessions.holder is controller.open_sessions.page and controller.open_sessions.page.engine is controller.host.engine
        follow_up = {"messages": HELLO["messages"] + [
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Again."}], "max_tokens": 4}
        again = client.post("/v1/chat/completions", json=follow_up)
        assert again.status_code == 200 and again.headers["x-infinigen-session"] == api_session
        assert controller.open_sessions.api.engine is controller.host.engine
    finally:
        for chat in {controller.open_sessions.page, controller.open_sessions.api} - {None}:
            chat.close()
        controller.host.engine.close()



def _follow_up(request: dict, answer, question: str) -> dict:
    return {"messages": request["messages"] + [
        {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": question}], "max_tokens": 4}


def test_cached_tokens_exclude_what_reopening_re_read_after_the_disk_limit_dropped_the_chunks(loaded):
    """The issue: cached_tokens said 362 of 377 prompt tokens were cached after the disk budget had dropped the
    session's chunks and they were re-read. A continued conversation reopened from intact chunks reports all
    it did not read as cached; one whose chunks the budget dropped reports the re-read tokens as read."""
    import dataclasses

    from sessions.budget import enforce_disk_limit

    client = api_client(loaded)
    dropped_request = {"messages": [{"role": "user", "content": "Name three mountains of Asia, please."}],
                       "max_tokens": 4}
    kept_request = {"messages": [{"role": "user", "content": "Name three rivers of Europe, please."}], "max_tokens": 4}
    dropped = client.post("/v1/chat/completions", json=dropped_request)
    kept = client.post("/v1/chat/completions", json=kept_request)  # closes the first (the API keeps one open)
    client.post("/v1/chat/completions", json=HELLO)  # closes the second; this one stays open (locked)
    dropped_id, kept_id = dropped.headers["x-infinigen-session"], kept.headers["x-infinigen-session"]
    assert loaded.store.chunks(dropped_id) and loaded.store.chunks(kept_id)

    storage = loaded.store.storage
    loaded.store.storage = dataclasses.replace(storage, kv_disk_limit=loaded.store.kv_bytes() - 1)
    assert enforce_disk_limit(loaded.store) == [dropped_id]  # the least recently used session's chunks go
    loaded.store.storage = storage
    assert not loaded.store.chunks(dropped_id) and loaded.store.chunks(kept_id)

    intact = client.post("/v1/chat/completions", json=_follow_up(kept_request, kept, "And lakes?"))
    assert intact.headers["x-infinigen-session"] == kept_id and intact.headers["x-infinigen-continued"] == "true"
    assert loaded.open_sessions.api.restore.tokens_prefilled == 0  # read back from its chunks, not re-read
    usage = intact.json()["usage"]
    assert 0 < usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] < 20  # the new turn only

    reread = client.post("/v1/chat/completions", json=_follow_up(dropped_request, dropped, "And glaciers?"))
    assert reread.headers["x-infinigen-session"] == dropped_id and reread.headers["x-infinigen-continued"] == "true"
    assert loaded.open_sessions.api.restore.tokens_prefilled > 20  # the whole stored conversation was read again
    usage = reread.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # every token of this prompt was read


def test_a_message_at_the_windows_edge_gets_the_same_answer_from_the_page_and_the_api(loaded):
    """One window rule with one reply reserve and one wording: what the page refuses, the API refuses in the same
    words, and what fits one fits the other."""
    from chat_service import UserError
    from ui.api import parse_chat_request
    from ui.api.serving import checked_prompt_ids

    chat = loaded.open_sessions.page
    window = loaded.host.engine.max_context
    base = chat.check_window(" ".join(["word"] * 7000)).needed_tokens  # " word" is one token per repeat
    words = 7000 + window - base  # the prompt and the reply's reserve fill the window exactly

    def api_answer(text: str):
        request = parse_chat_request({"messages": [{"role": "user", "content": text}]}, "SmolLM2-135M-Instruct",
                                     loaded.settings.current.sampling)
        return checked_prompt_ids(loaded, request)

    fits = " ".join(["word"] * words)
    assert chat.check_window(fits).fits and chat.check_window(fits).needed_tokens == window
    assert len(api_answer(fits)) + REPLY_RESERVE_TOKENS == window  # accepted by both

    too_long = " ".join(["word"] * (words + 1))
    with pytest.raises(UserError) as page_refusal:
        list(loaded.page_turns.send(too_long))
    response = api_client(loaded).post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                                     "content": too_long}]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert response.json()["error"]["message"] == str(page_refusal.value)
    assert f"{window + 1:,} tokens" in str(page_refusal.value) and "Nothing was sent" in str(page_refusal.value)
    assert chat.messages == [] and [s.origin for s in loaded.store.list()] == ["app"]  # nothing stored, no API session


def test_a_large_pdf_converts_off_the_event_loop_while_other_requests_are_answered(loaded, monkeypatch):
    """Converting an attachment takes seconds: while it runs, the server's event loop (the page's too) answers."""
    import base64

    from test_documents import pdf_bytes

    from ui.api import protocol

    started, finished = threading.Event(), threading.Event()
    convert = protocol.convert_bytes

    def converting(name, data):  # the real conversion, observed
        started.set()
        try:
            return convert(name, data)
        finally:
            finished.set()

    monkeypatch.setattr(protocol, "convert_bytes", converting)
    pages = [[f"Line {line} of page {page}: the harbour log lists the ships." for line in range(12)]
             for page in range(2000)]
    data_url = "data:application/pdf;base64," + base64.b64encode(pdf_bytes(pages)).decode()
    request = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "How many ships?"},
        {"type": "file", "file": {"filename": "log.pdf", "file_data": data_url}}]}], "max_tokens": 4}
    answers = []
    with TestClient(FastAPI(routes=api_routes(loaded, ApiOptions()))) as client:  # one event loop for both
        sender = threading.Thread(target=lambda: answers.append(client.post("/v1/chat/completions", json=request)))
        sender.start()
        assert started.wait(timeout=120)
        models = client.get("/v1/models")
        converting_still = not finished.is_set()
        sender.join(timeout=300)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert converting_still  # answered while the PDF was still being converted
    # far longer than the window: read by passages (issue 32), the pages read named in the header
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].headers["x-infinigen-document-read"].startswith("log.pdf: page")
