"""Everything the app does, without Gradio: the composition of its parts, for the page, the API and tests.

The app is a local, single-user program: one controller per process holds the engine and the session
that is open. Turns run one at a time (a second request while one runs gets a clear "busy" error), so
two browser tabs can never interleave writes; another process gets the session lock's "open elsewhere".
Every user-facing failure is raised as `UserError` with a message meant to be shown as it is.

    controller = ChatController(data_dir, model=None, device="auto")
    controller.load_in_background()
    for history in controller.send("Hello"): ...

The parts, one job each: `host` (ModelHost: the model, loading and switching), `preferences`
(SettingsKeeper), `turns` (TurnRunner: one generation at a time, Stop, progress), `open_sessions`
(OpenSessions: whose KV the engine holds), `pages` (PageSessions: the page's session actions),
`page_turns` (PageTurns) and `api` (ApiConversations: the OpenAI API's turns).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from infinigen_core import GenerationEvent, SamplingConfig
from sessions import ChatSession, SessionStore, StorageConfig
from sessions.budget import enforce_disk_limit

from . import inspector
from .api.conversations import ApiConversations, ApiTurn
from .errors import BUSY, Abandoned, QueueFull, UserError
from .model_host import ModelHost
from .open_sessions import OpenSessions
from .page_sessions import PageSessions
from .page_turns import PageTurns
from .settings import Settings, SettingsKeeper, apply_storage, engine_config
from .turns import TurnProgress, TurnRunner

__all__ = ["BUSY", "Abandoned", "ApiTurn", "ChatController", "QueueFull", "Settings", "TurnProgress", "UserError"]


class ChatController:
    DEFAULT_CHOICE = ModelHost.DEFAULT_CHOICE

    def __init__(self, data_dir: Path | str | None = None, model: str | None = None, device: str = "auto",
                 loader: Callable | None = None, quantize: str | None = None,
                 storage: StorageConfig | None = None) -> None:
        self.store = SessionStore(data_dir, storage)
        self.host = ModelHost(model, device, quantize, loader)
        self.preferences = SettingsKeeper()
        self.turns = TurnRunner()
        self.open_sessions = OpenSessions(self.store, self.host)
        parts = (self.store, self.host, self.preferences, self.turns, self.open_sessions)
        self.pages = PageSessions(*parts)
        self.page_turns = PageTurns(self.pages)
        self.api = ApiConversations(*parts)

    # ------------------------------------------------------------------ state the page and the API read
    engine = property(lambda self: self.host.engine)
    model_path = property(lambda self: self.host.model_path)
    status = property(lambda self: self.host.status)
    load_error = property(lambda self: self.host.load_error)
    ready = property(lambda self: self.host.ready)
    loaded_at = property(lambda self: self.host.loaded_at)
    settings = property(lambda self: self.preferences.current)
    progress = property(lambda self: self.turns.progress)
    restore_message = property(lambda self: self.pages.restore_message)
    api_turns = property(lambda self: self.api.turns_run)
    busy = property(lambda self: self.turns.busy())  # a turn (the page's or the API's) holds the engine now

    @property
    def chat(self) -> ChatSession | None:
        """The session the page shows."""
        return self.open_sessions.page

    @property
    def api_chat(self) -> ChatSession | None:
        """The API's latest conversation, kept open for its next request."""
        return self.open_sessions.api

    # ------------------------------------------------------------------ the model
    def _engine_config(self):
        return engine_config(self.preferences.current, self.host.engine)

    def load(self, progress: Callable[[str], None] = print) -> None:
        """Load the model (download, convert and calibrate on first use), then open the latest session."""
        def opened() -> None:
            self.pages.open_latest_free()
            enforce_disk_limit(self.store)  # a lower limit than last time takes effect at once

        self.host.load(self._engine_config, progress, then=opened)

    def load_in_background(self, progress: Callable[[str], None] = print) -> threading.Thread:
        thread = threading.Thread(target=self.load, args=(progress,), daemon=True, name="model-loader")
        thread.start()
        return thread

    def model_choices(self) -> list[tuple[str, str]]:
        return self.host.model_choices()

    def model_summary(self) -> str:
        return self.host.model_summary()

    def switch_model(self, choice: str | None, progress: Callable[[str], None] = print) -> str:
        """Load another model (default, hub id or path) and reopen the open session under it.

        The old model is unloaded first; if the new one fails to load, the old one is loaded again and the
        error says why. Each model's KV chunks of a session are kept, so switching back restores the session
        from disk. Raises UserError."""
        wanted = self.host.wanted(choice)
        if not self.host.ready.is_set():
            raise UserError(f"Still starting: {self.host.status}")
        if self.host.engine is not None and wanted == self.host.model_path:
            return f"{self.host.engine.model_name} is already loaded."
        with self.turns.exclusive():
            session_id = self.chat.id if self.chat is not None else None
            self.open_sessions.close_all()  # every open session holds the old engine; the new one starts empty
            failure = self.turns.model_thread.call(self.host.swap, wanted, self._engine_config, progress)
        if session_id is not None:
            self.pages.open_session(session_id)
        else:
            self.pages.open_latest_free()
        self.host.status = self.host.ready_line()
        if failure:
            raise UserError(failure)
        return f"Switched to {self.host.model_summary()}. {self.pages.restore_message}"

    def inspect(self, step_index: int, layer: int) -> str:
        """The prefetch inspector's HTML for a recent decode step (0 = the oldest kept) and a layer. It recomputes
        the layer's attention, so it runs in the model's thread (engine_thread.py), after a turn running there."""
        return self.turns.model_thread.call(inspector.render, self.engine, step_index, layer)

    # ------------------------------------------------------------------ settings
    def apply_settings(self, *values) -> str:
        """policy, alpha, budget, partial_ratio, pool_limit, inspect, temperature, top_p, top_k,
        repetition_penalty, max_new_tokens[, min_fetch_tokens]: see SettingsKeeper.apply. Raises UserError."""
        return self.preferences.apply(self.host.engine, *values)

    def apply_storage(self, kv_format: str, disk_limit: str) -> str:
        return apply_storage(self.store, kv_format, disk_limit)

    # ------------------------------------------------------------------ the page's sessions
    def chat_history(self) -> list[dict]:
        return self.pages.chat_history()

    def new_session(self, system_prompt: str = "") -> str:
        return self.pages.new_session(system_prompt)

    def open_session(self, session_id: str) -> str:
        return self.pages.open_session(session_id)

    def rename_session(self, title: str) -> None:
        self.pages.rename_session(title)

    def delete_session(self) -> None:
        self.pages.delete_session()

    def export_session(self, folder: Path) -> Path:
        return self.pages.export_session(folder)

    def import_session(self, path: str | Path) -> str:
        return self.pages.import_session(path)

    def branch_from(self, message_index: int) -> str:
        return self.pages.branch_from(message_index)

    def set_system_prompt(self, text: str) -> None:
        self.pages.set_system_prompt(text)

    # ------------------------------------------------------------------ turns
    def send(self, text: str, attachments=()) -> Iterator[list[dict]]:
        return self.page_turns.send(text, attachments)

    def regenerate(self) -> Iterator[list[dict]]:
        return self.page_turns.regenerate()

    def edit_last(self, text: str) -> Iterator[list[dict]]:
        return self.page_turns.edit_last(text)

    def drop_oldest_turns(self, text: str) -> str:
        return self.page_turns.drop_oldest_turns(text)

    def stop(self) -> None:
        self.turns.stop()

    def answer_api(self, system: str, turns: list[tuple[str, str]], prompt_ids: list[int],
                   sampling: SamplingConfig, cancel: threading.Event, turn: ApiTurn,
                   max_waiting: int, documents=()) -> Iterator[GenerationEvent]:
        return self.api.answer(system, turns, prompt_ids, sampling, cancel, turn, max_waiting, documents)
