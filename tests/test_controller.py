"""The app's controller without Gradio: start-up beside another app process, settings kept per session."""

from pathlib import Path

from sessions import SessionStore
from sessions.lock import SessionLock
from ui.controller import ChatController


def _controller(data_dir: Path, engine) -> ChatController:
    controller = ChatController(data_dir, loader=lambda *args, **kwargs: engine)
    controller.load(progress=lambda message: None)
    assert controller.load_error is None, controller.load_error
    return controller


def test_a_second_app_process_starts_on_a_session_the_first_does_not_hold(tmp_path, real_engine):
    store = SessionStore(tmp_path)
    older = store.create("older")
    newest = store.create("newest")
    held_elsewhere = SessionLock(tmp_path / "locks" / f"{newest}.lock").acquire()  # like another process
    try:
        controller = _controller(tmp_path, real_engine)
        assert controller.chat.id == older and "Ready" in controller.status
        controller.chat.close()
        held_too = SessionLock(tmp_path / "locks" / f"{older}.lock").acquire()
        try:
            controller = _controller(tmp_path, real_engine)
            assert controller.chat.id not in (older, newest)  # every session taken: a new one
        finally:
            controller.chat.close()
            held_too.release()
    finally:
        held_elsewhere.release()


def test_a_session_records_the_settings_its_turns_ran_with(tmp_path, real_engine):
    controller = _controller(tmp_path, real_engine)
    try:
        created = controller.store.get(controller.chat.id).settings
        assert created["policy"] == "infinigen" and created["budget"] == "0.15"
        controller.apply_settings("h2o", 12, "0.3", 0.5, "", False, 0.0, 1.0, 0, 1.0, 4)
        list(controller.send("Hello"))
        stored = controller.store.get(controller.chat.id).settings
        assert stored["policy"] == "h2o" and stored["budget"] == "0.3" and stored["max_new_tokens"] == 4
        assert real_engine.config.policy == "h2o"
    finally:
        controller.chat.close()
