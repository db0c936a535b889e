"""The app's service without Gradio: start-up beside another app process, settings kept per session."""

import time
from pathlib import Path

import pytest

from chat_service import ChatService, UserError
from chat_service.settings import SettingsForm, apply_storage
from sessions import SessionStore, StorageConfig
from sessions.lock import SessionLock


def _service(data_dir: Path, engine) -> ChatService:
    service = ChatService(data_dir, loader=lambda *args, **kwargs: engine)
    service.load(progress=lambda message: None)
    assert service.host.load_error is None, service.host.load_error
    return service


def _settings(service: ChatService, **values) -> str:
    return service.settings.apply(service.host.engine, SettingsForm(**values))


def test_a_second_app_process_starts_on_a_session_the_first_does_not_hold(tmp_path, real_engine):
    store = SessionStore(tmp_path)
    older = store.create("older")
    newest = store.create("newest")
    held_elsewhere = SessionLock(tmp_path / "locks" / f"{newest}.lock").acquire()  # like another process
    try:
        service = _service(tmp_path, real_engine)
        assert service.open_sessions.page.id == older and "Ready" in service.host.status
        service.open_sessions.page.close()
        held_too = SessionLock(tmp_path / "locks" / f"{older}.lock").acquire()
        try:
            service = _service(tmp_path, real_engine)
            assert service.open_sessions.page.id not in (older, newest)  # every session taken: a new one
        finally:
            service.open_sessions.page.close()
            held_too.release()
    finally:
        held_elsewhere.release()


def test_a_session_records_the_settings_its_turns_ran_with(tmp_path, real_engine):
    service = _service(tmp_path, real_engine)
    try:
        created = service.store.get(service.open_sessions.page.id).settings
        assert created["policy"] == "infinigen" and created["budget"] == "0.15"
        _settings(service, policy="h2o", alpha=12, budget="0.3", max_new_tokens=4)
        list(service.page_turns.send("Hello"))
        stored = service.store.get(service.open_sessions.page.id).settings
        assert stored["policy"] == "h2o" and stored["budget"] == "0.3" and stored["max_new_tokens"] == 4
        assert real_engine.config.policy == "h2o"
        _settings(service, policy="h2o", alpha=12, budget="0.3", temperature=0.7, top_p=0.9,
                  max_new_tokens=3)  # sampling only
        list(service.page_turns.send("Thanks"))
        stored = service.store.get(service.open_sessions.page.id).settings
        assert stored["temperature"] == 0.7 and stored["max_new_tokens"] == 3 and stored["min_fetch_tokens"] == 256
        for bad_floor, message in ((-5, "min_fetch_tokens"), (2.5, "whole number")):
            with pytest.raises(UserError, match=message):
                _settings(service, max_new_tokens=8, min_fetch_tokens=bad_floor)
        assert service.settings.current.min_fetch_tokens == 256  # the bad values changed nothing
    finally:
        service.open_sessions.page.close()


def test_app_flags_default_to_a_private_local_server():
    from ui.cli import parse_args

    args = parse_args([])
    assert (args.host, args.port, args.share, args.quantize, args.device) == ("127.0.0.1", 7860, False, None, "auto")
    args = parse_args(["--port", "8000", "--quantize", "4bit", "--data-dir", "~/chats"])
    assert args.port == 8000 and args.quantize == "4bit" and str(args.data_dir) == "~/chats"
    assert args.storage == StorageConfig()  # int8 chunks, a share of the free space
    args = parse_args(["--kv-disk-limit", "20GiB", "--kv-format", "exact"])
    assert args.storage == StorageConfig(kv_format="exact", kv_disk_limit=20 * 2**30)
    for bad in (["--port", "0"], ["--quantize", "3bit"], ["--device", "tpu"], ["--kv-disk-limit", "lots"],
                ["--kv-format", "zip"]):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(bad)
        assert exit_info.value.code == 2


def test_the_api_flags_and_the_key_an_exposed_api_needs(monkeypatch):
    from ui.cli import parse_args

    monkeypatch.delenv("INFINIGEN_API_KEY", raising=False)
    args = parse_args([])
    assert args.api and args.api_key is None and args.api_max_waiting == 4  # on, keyless, on loopback only
    assert not parse_args(["--no-api", "--host", "0.0.0.0", "--api-key", "k"]).api  # the key guards the page
    assert not parse_args(["--no-api"]).api  # on loopback the page needs no key
    assert parse_args(["--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    assert parse_args(["--host", "::1"]).api_key is None  # IPv6 loopback needs no key
    monkeypatch.setenv("INFINIGEN_API_KEY", "from-env")
    assert parse_args(["--host", "192.168.1.5"]).api_key == "from-env"
    monkeypatch.delenv("INFINIGEN_API_KEY")
    for bad in (["--api-max-waiting", "-1"], ["--api-key", " "], ["--share"], ["--host", "example.org"],
                ["--no-api", "--host", "0.0.0.0"], ["--no-api", "--share"]):  # the page alone is exposed too
        with pytest.raises(SystemExit) as exit_info:
            parse_args(bad)
        assert exit_info.value.code == 2


def test_an_exposed_app_without_an_api_key_refuses_to_start_and_says_why(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "INFINIGEN_API_KEY"}
    done = subprocess.run([sys.executable, "app.py", "--host", "0.0.0.0", "--data-dir", str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "--api-key" in done.stderr and "0.0.0.0" in done.stderr and "loopback" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written
    page_only = subprocess.run([sys.executable, "app.py", "--no-api", "--host", "0.0.0.0", "--data-dir",
                                str(tmp_path)], cwd=Path(__file__).resolve().parents[1], env=env,
                               capture_output=True, text=True, timeout=120)
    assert page_only.returncode == 2  # --no-api leaves the page, which the key guards as well
    assert "--api-key" in page_only.stderr and "chat page" in page_only.stderr
    assert not any(tmp_path.iterdir())


def test_the_kv_storage_setting_applies_at_once_and_spares_the_open_session(tmp_path, real_engine):
    service = _service(tmp_path, real_engine)
    try:
        _settings(service, max_new_tokens=4)  # short replies
        list(service.page_turns.send("What is the capital of France?"))
        first = service.open_sessions.page.id
        service.pages.new_session()
        list(service.page_turns.send("And of Italy?"))
        with pytest.raises(UserError, match="not a size"):
            apply_storage(service.store, "int8", "a lot")
        assert service.store.storage == StorageConfig()  # the bad value changed nothing
        message = apply_storage(service.store, "exact", "1KiB")  # smaller than any chat: all but the open one go
        assert "dropped the KV cache of 1" in message and service.store.storage.kv_format == "exact"
        summaries = {s.id: s for s in service.store.list()}
        assert summaries[service.open_sessions.page.id].reopens_instantly and not summaries[first].reopens_instantly
        assert summaries[first].message_count == 2  # its text stays
    finally:
        service.open_sessions.page.close()


def test_deleting_the_open_session_opens_the_latest_page_session_not_an_api_one(tmp_path, real_engine):
    store = SessionStore(tmp_path)
    kept = store.create("kept")
    service = _service(tmp_path, real_engine)
    try:
        doomed = service.pages.new_session()
        store.create("an API conversation", origin="api")  # the most recent, but the API's
        assert service.open_sessions.page.id == doomed
        service.pages.delete_session()
        assert service.open_sessions.page.id == kept and doomed not in [s.id for s in store.list()]
    finally:
        service.open_sessions.page.close()


def test_the_page_shows_the_end_of_a_reply_before_the_turn_is_saved(tmp_path, real_engine, monkeypatch):
    from chat_service import page_turns
    from sessions.chunk_writer import SessionChunks

    service = _service(tmp_path, real_engine)
    chat_id = service.open_sessions.page.id
    shown: list[str] = []
    saw_the_end_before_the_save: list[bool] = []
    save = SessionChunks.persist

    def watched_save(self, engine, boundary=None, background=False):
        if not background:  # the turn's end (the stored reply is final by now): has the page shown it?
            final = service.store.messages(chat_id)[-1].content
            deadline = time.monotonic() + 5.0
            while final not in shown and time.monotonic() < deadline:
                time.sleep(0.01)
            saw_the_end_before_the_save.append(final in shown)
        return save(self, engine, boundary, background)

    monkeypatch.setattr(SessionChunks, "persist", watched_save)
    monkeypatch.setattr(page_turns, "PAGE_UPDATE_SECONDS", 60.0)  # no update falls due: only the end's own
    try:
        _settings(service, max_new_tokens=5)
        for history in service.page_turns.send("Hello"):
            if history[-1]["role"] == "assistant":
                shown.append(history[-1]["content"])
        assert saw_the_end_before_the_save == [True]
        assert shown[-1] == service.store.messages(chat_id)[-1].content
    finally:
        service.open_sessions.page.close()


def test_the_page_shows_a_message_at_once_and_a_turn_that_fails_leaves_it_in_the_box(tmp_path, real_engine,
                                                                                   monkeypatch):
    import gradio as gr

    from sessions import SessionError
    from sessions.chat import ChatSession
    from ui.page_actions import EMPTY_BOX, PageActions

    service = _service(tmp_path, real_engine)
    actions = PageActions(service, export_dir=None)
    try:
        _settings(service, max_new_tokens=3)
        updates = actions.send("Hello")
        history, box, note, _status, sessions = next(updates)  # before the model has read it
        assert history == [{"role": "user", "content": "Hello"}] and box == gr.skip() and note == gr.skip()
        assert sessions == gr.skip()
        rest = list(updates)
        assert rest[0][1] == EMPTY_BOX  # emptied once the turn started
        assert rest[0][4]["choices"][0][0].startswith("Hello · ")  # the session list shows its new title at once
        assert any(status != gr.skip() and "Ready" not in status for *_, status, _ in rest)  # the turn's phase
        assert [m["role"] for m in rest[-1][0]] == ["user", "assistant"] and rest[-1][0][1]["content"]

        def refuse(*args, **kwargs):
            raise SessionError("the disk is full")

        monkeypatch.setattr(ChatSession, "send", refuse)
        updates = actions.send("Again")
        assert next(updates)[0][-1] == {"role": "user", "content": "Again"}
        history, box, *_ = next(updates)  # the turn failed: the chat as stored, the box left as it was
        assert history == rest[-1][0] and box == gr.skip()
        with pytest.raises(gr.Error, match="the disk is full"):
            next(updates)
        assert len(service.open_sessions.page.messages) == 2
    finally:
        service.open_sessions.page.close()


def test_a_page_turn_with_a_live_reply_sends_the_chat_only_as_the_reply_starts_and_ends(tmp_path, real_engine,
                                                                                       monkeypatch):
    from chat_service import page_turns
    from chat_service.live_replies import LiveReply
    from chat_service.page_turns import LIVE_PLACEHOLDER
    from ui.page_actions import PageActions

    service = _service(tmp_path, real_engine)
    actions = PageActions(service, export_dir=None)
    monkeypatch.setattr(page_turns, "PAGE_UPDATE_SECONDS", 0.0)  # every token written
    written: list[str] = []
    write = LiveReply.write
    monkeypatch.setattr(LiveReply, "write", lambda self, text: (written.append(text), write(self, text)))
    try:
        _settings(service, max_new_tokens=8)
        updates = [history for history, *_ in actions.send("Hello", "a" * 32)]  # the page's send, its reply named
        stored = service.store.messages(service.open_sessions.page.id)[-1].content
        assert updates[0] == [{"role": "user", "content": "Hello"}]  # at once, before the model read it
        assert updates[1] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": LIVE_PLACEHOLDER}]
        assert updates[2:] == [[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": stored}]]
        assert len(written) >= 2 and all(after.startswith(before) for before, after in zip(written, written[1:]))
        reply = service.live_replies.find("a" * 32)
        assert reply.read().text == stored and reply.read().done

        # regenerated: the reply it replaces goes as the new one starts
        updates = list(actions.regenerate("c" * 32))
        assert updates[0] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": LIVE_PLACEHOLDER}]
        assert updates[1:] == [service.pages.chat_history()] and service.live_replies.find("c" * 32).read().done

        # without a live reply (a script's call) the text comes in the chat's updates, the reply shown once in each
        updates = list(service.page_turns.send("Again"))
        again = {"role": "user", "content": "Again"}
        assert all([m["role"] for m in update[update.index(again) + 1:]] == ["assistant"] for update in updates[1:])
        assert updates[-1][-1]["content"] == service.store.messages(service.open_sessions.page.id)[-1].content
    finally:
        service.open_sessions.page.close()


@pytest.mark.parametrize("failure", ["session", "model"])
def test_a_live_turn_that_fails_after_its_reply_began_shows_the_chat_as_stored(tmp_path, real_engine, monkeypatch,
                                                                              failure):
    import gradio as gr

    from chat_service.page_turns import LIVE_PLACEHOLDER
    from sessions import SessionError
    from sessions.chat import ChatSession
    from ui.page_actions import PageActions

    service = _service(tmp_path, real_engine)
    actions = PageActions(service, export_dir=None)
    send = ChatSession.send
    # a SessionError reaches the page as an error toast; any other failure in the model's thread as itself
    error, shown_as = {"session": (SessionError, gr.Error), "model": (RuntimeError, RuntimeError)}[failure]

    def fails_after_a_token(self, *args, **kwargs):
        events = send(self, *args, **kwargs)
        yield next(events)
        events.close()
        raise error("the disk is full")

    monkeypatch.setattr(ChatSession, "send", fails_after_a_token)
    try:
        _settings(service, max_new_tokens=8)
        updates = actions.send("Hello", "b" * 32)
        next(updates)
        assert next(updates)[0][-1]["content"] == LIVE_PLACEHOLDER
        assert next(updates)[0] == service.pages.chat_history()  # the placeholder gone
        with pytest.raises(shown_as, match="the disk is full"):
            next(updates)
        assert service.live_replies.find("b" * 32).read().done
    finally:
        service.open_sessions.page.close()
