"""The composition root: builds the app's parts once, for the page, the API and tests.

The app is a local, single-user program: one service per process holds the engine and the sessions that
are open. Turns run one at a time (the page is refused while one runs, API requests wait their turn), so
two browser tabs can never interleave writes; another process gets the session lock's "open elsewhere".
Every user-facing failure is raised as `UserError` with a message meant to be shown as it is.

    service = ChatService(data_dir, model=None, device="auto")
    service.load_in_background()
    for history in service.page_turns.send("Hello"): ...

There is no forwarding layer: the faces call the part they need. `store` (SessionStore), `host` (ModelHost:
the model, loading and switching), `settings` (SettingsKeeper), `turns` (TurnRunner: one generation at a
time, Stop, progress), `open_sessions` (OpenSessions: whose KV the engine holds), `pages` (PageSessions: the
page's session actions), `page_turns` (PageTurns), `live_replies` (LiveReplies: the page's replies as they
grow) and `api` (ApiTurns: the OpenAI API's turns). Only what
spans several parts (start-up, switching models) is a method here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from infinigen_core import EngineConfig
from sessions import SessionStore, StorageConfig
from sessions.budget import enforce_disk_limit

from .api_turns import ApiTurns
from .backend_client import BackendConfig
from .document_reading import DocumentReader
from .errors import UserError
from .live_replies import LiveReplies
from .model_host import ModelHost
from .open_sessions import OpenSessions
from .page_sessions import PageSessions
from .page_turns import PageTurns
from .remote_host import RemoteHost
from .settings import SettingsKeeper, engine_config
from .turns import TurnRunner


class ChatService:
    def __init__(self, data_dir: Path | str | None = None, model: str | None = None, device: str = "auto",
                 loader: Callable | None = None, quantize: str | None = None,
                 storage: StorageConfig | None = None, backend: BackendConfig | None = None) -> None:
        self.store = SessionStore(data_dir, storage)
        # the one place local and remote generation part: the host opens each session for one or the other
        self.host = RemoteHost(backend) if backend is not None else ModelHost(model, device, quantize, loader)
        self.settings = SettingsKeeper()
        self.turns = TurnRunner(self.settings, self.store, self.host)
        self.open_sessions = OpenSessions(self.store, self.host)
        parts = (self.store, self.host, self.settings, self.turns, self.open_sessions)
        self.pages = PageSessions(*parts)
        self.documents = DocumentReader(self.store.data_dir / "passages")
        self.page_turns = PageTurns(self.pages, self.documents)
        self.live_replies = LiveReplies()  # the replies the page reads as they grow (its own route)
        self.api = ApiTurns(*parts)

    def _engine_config(self) -> EngineConfig:
        return engine_config(self.settings.current, self.host.engine)

    def load(self, progress: Callable[[str], None] = print) -> None:
        """Load the model (download, convert and calibrate on first use), then open the latest session."""
        def opened() -> None:
            if self.host.engine is not None:  # a remote server has none here
                self.settings.settle(self.host.engine)  # the model family's defaults, before a session opens
            self.pages.open_latest_free()
            enforce_disk_limit(self.store)  # a lower limit than last time takes effect at once

        self.host.load(self._engine_config, progress, then=opened)

    def load_in_background(self, progress: Callable[[str], None] = print) -> threading.Thread:
        thread = threading.Thread(target=self.load, args=(progress,), daemon=True, name="model-loader")
        thread.start()
        return thread

    def switch_model(self, choice: str | None, progress: Callable[[str], None] = print) -> str:
        """Load another model (default, hub id or path) and reopen the open session under it.

        The old model is unloaded first; if the new one fails to load, the old one is loaded again and the
        error says why. Each model's KV chunks of a session are kept, so switching back restores the session
        from disk. Raises UserError."""
        host = self.host
        wanted = host.wanted(choice)
        if host.remote:
            raise UserError("The model is the backend's: to use another, start the server with it (or point "
                            "--backend-model at another model it serves).")
        if not host.ready.is_set():
            raise UserError(f"Still starting: {host.status}")
        if host.engine is not None and wanted == host.model_path:
            return f"{host.engine.model_name} is already loaded."
        with self.turns.exclusive():
            page = self.open_sessions.page
            session_id = page.id if page is not None else None
            self.open_sessions.close_all()  # every open session holds the old engine; the new one starts empty
            failure = self.turns.model_thread.call(host.swap, wanted, self._engine_config, progress)
            if host.engine is not None:  # the new model, or the old one again: its family's defaults
                self.turns.model_thread.call(self.settings.settle, host.engine)
        if session_id is not None:
            self.pages.open_session(session_id)
        else:
            self.pages.open_latest_free()
        host.status = host.ready_line()
        if failure:
            raise UserError(failure)
        return f"Switched to {host.model_summary()}. {self.pages.restore_message}"
