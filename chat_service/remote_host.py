"""The host of a front app whose replies come from a remote OpenAI-compatible server (`--backend URL`):
ModelHost's part for the rest of the service (start-up, what the page says, which session object a turn
runs in), with no engine here.

    host = RemoteHost(BackendConfig("http://gpu-box:8000/v1"))
    host.load(config, progress=print, then=open_latest)   # asks the server for its model; never fails start-up
"""

from __future__ import annotations

import time
from collections.abc import Callable

from infinigen_core import EngineConfig
from sessions import SessionStore, WindowCheck

from .backend_client import BackendClient, BackendConfig, BackendError, TurnFigures
from .backend_tokens import BackendTokens
from .errors import UserError
from .model_host import ModelHost, Report
from .remote_chat import RemoteChat


class RemoteHost(ModelHost):
    remote = True

    def __init__(self, config: BackendConfig) -> None:
        super().__init__()
        self.client = BackendClient(config)
        self.tokens = BackendTokens(self.client)  # the server's tokenizer, where it serves one
        self.connected = False  # start-up has asked the server (whatever it answered)
        self.backend_problem: str | None = None  # why the server could not be asked at start-up

    def load(self, config: Callable[[], EngineConfig], progress: Report = print,
             then: Callable[[], None] = lambda: None) -> None:
        """Ask the server for its model and window, then run `then`. A server that is down or refuses is said
        on the status line, not fatal: every message asks it again, and says what went wrong then."""
        report = self._reporter(progress)
        try:
            report(f"Asking the backend at {self.client.config.url} for its model...")
            try:
                self.client.probe()
            except BackendError as error:
                self.backend_problem = str(error)
            self.connected = True
            self.loaded_at = time.time()
            then()
            report(self.ready_line())
        except Exception as error:  # noqa: BLE001  shown in the UI instead of a frozen page
            self.load_error = f"Could not start: {error}"
            report(self.load_error)
        finally:
            self.ready.set()

    @property
    def status(self) -> str:
        """Once started, what the server said last (it may come up, or go away, after the app)."""
        return self.ready_line() if self.connected and self.load_error is None else self._status

    @status.setter
    def status(self, value: str) -> None:
        self._status = value

    def require_ready(self) -> None:
        if not self.ready.is_set():
            raise UserError(f"Still starting: {self.status}")
        self.require_loaded()

    def require_loaded(self) -> None:
        if not self.connected:
            raise UserError(self.load_error or f"Still starting: {self.status}")

    def is_ready(self) -> bool:
        return self.connected and self.ready.is_set() and self.load_error is None

    def fingerprint(self) -> str:
        return f"remote:{self.client.model_name()}"

    def open_chat(self, store: SessionStore, session_id: str, progress=None) -> RemoteChat:
        return RemoteChat.open(store, self.client, session_id, self.tokens)

    def window_check(self, turns: list[dict]) -> WindowCheck:
        """Whether an API request's whole conversation and a short reply fit the server model's window."""
        users = sum(1 for turn in turns if turn["role"] == "user")
        return self.tokens.window_check(turns, max(users - 1, 0))

    def turn_figures(self) -> TurnFigures | None:
        return self.client.last

    def served_model(self) -> str:
        """The backend's model; asked again when start-up could not (BackendError when it still cannot)."""
        if self.client.model is None:
            self.client.probe()
            self.backend_problem = None
        return self.client.model_name()

    def window(self) -> int | None:
        return self.client.model.window if self.client.model is not None else None

    # ------------------------------------------------------------------ what the page shows
    def model_choices(self) -> list[tuple[str, str]]:
        return [(f"{self.client.model_name() or 'the model'} (on the backend)", self.DEFAULT_CHOICE)]

    def backend_line(self) -> str:
        """The server's model, where it is, and its window."""
        window = self.window()
        said = f"window {window:,} tokens" if window else "window not reported"
        return f"{self.client.model_name() or 'Its model (not known yet)'} on the backend {self.client.config.url} · {said}"

    def model_summary(self) -> str:
        return f"{self.backend_line()} · the KV cache and its statistics live on that server"

    def ready_line(self) -> str:
        if self.backend_problem and self.client.model is None:  # asked again by the next message
            return f"Backend {self.client.config.url}: {self.backend_problem}"
        return f"Ready: {self.client.model_name()} on the backend {self.client.config.url}"
