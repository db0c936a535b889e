"""One generation at a time, for the page and the API alike: the lock, the API's bounded queue, Stop, progress,
the one thread the model runs in (engine_thread.py), and the one turn runner both faces use.

    turns = TurnRunner(settings, store, host)
    with turns.exclusive():                      # the page: UserError(BUSY) when a reply is being generated
        for events in turns.run(session_of_turn, generate, interval_s=0.5, stop=turns.stop): ...
    with turns.queued(client_gone, max_waiting): # the API: waits its turn, QueueFull past the bound
        for events in turns.run(session_of_turn, generate, interval_s=0, stop=client_gone.set): ...
    turns.model_thread.call(restore, ...)         # other model work runs in that thread, under the lock
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from infinigen_core import ConfigError, ContextOverflowError, GenerationEvent
from sessions import SessionError, SessionStore

from .engine_thread import model_thread
from .errors import BUSY, Abandoned, QueueFull, UserError
from .model_host import ModelHost
from .remote_chat import OpenChat
from .settings import SettingsKeeper

WAIT_POLL_S = 0.2  # how often a waiting API request looks whether its client went away
Progress = Callable[[int, int], None]
# what a face's turn does in the model's thread: pick its session (its KV in the engine), then generate in it
SessionOfTurn = Callable[[], OpenChat]
Generate = Callable[[OpenChat, Progress], Iterable[GenerationEvent]]


@dataclass
class TurnProgress:
    """What the UI shows while a turn runs."""

    phase: str = "idle"  # idle | restore | prefill | generating
    done: int = 0
    total: int = 0
    started: float = 0.0
    tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def tokens_per_second(self) -> float:
        """The reply's rate from its first token to its latest: after the turn it stays what it was (measured
        to the present, the timing panel's figure decayed after a reply and changed at every tick)."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / max(self.last_token_at - self.first_token_at, 1e-9)


class EitherSet:
    """A cancel flag that is set when any of its events is: the API client going away, the page's Stop button."""

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self._events)


class TurnRunner:
    """The engine runs one turn at a time; the page is refused while one runs, API requests queue up to a bound."""

    def __init__(self, settings: SettingsKeeper, store: SessionStore, host: ModelHost) -> None:
        self.settings, self.store, self.host = settings, store, host
        self.cancel = threading.Event()  # the page's Stop button
        self.progress = TurnProgress()
        self._lock = threading.Lock()
        self._waiting = 0  # API requests waiting for their turn
        self._waiting_lock = threading.Lock()
        self.model_thread = model_thread()

    @property
    def waiting(self) -> int:
        return self._waiting

    def busy(self) -> bool:
        return self._lock.locked()

    def refuse_while_generating(self) -> None:
        """For actions that create something before opening it: refuse up front rather than half-way."""
        if self.busy():
            raise UserError(BUSY)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The turn now, or UserError(BUSY)."""
        if not self._lock.acquire(blocking=False):
            raise UserError(BUSY)
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def queued(self, cancel: threading.Event, max_waiting: int) -> Iterator[None]:
        """The turn once it comes: QueueFull when `max_waiting` requests already wait, Abandoned when `cancel`
        (the client going away, not the page's Stop) is set while waiting."""
        with self._waiting_lock:
            if self._lock.locked() and self._waiting >= max_waiting:
                raise QueueFull(f"{self._waiting} requests are already waiting for the model: retry later")
            self._waiting += 1
        try:
            while not self._lock.acquire(timeout=WAIT_POLL_S):
                if cancel.is_set():
                    raise Abandoned("the client went away while waiting")
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def stop(self) -> None:
        self.cancel.set()

    def start(self, phase: str) -> Callable[[int, int], None]:
        """A new progress record in `phase`; returns the (done, total) callback that fills it in."""
        self.progress = progress = TurnProgress(phase=phase, started=time.perf_counter())

        def on_progress(done: int, total: int) -> None:
            progress.done, progress.total = done, total

        return on_progress

    def track(self, events: Iterable[GenerationEvent]) -> Iterator[GenerationEvent]:
        """Pass a turn's events on, counting tokens and marking the first one."""
        for event in events:
            if self.progress.first_token_at is None:
                self.progress.first_token_at = time.perf_counter()
                self.progress.phase = "generating"
            if event.finish_reason is None:
                self.progress.tokens += 1
                self.progress.last_token_at = time.perf_counter()
            yield event

    def idle(self) -> None:
        self.progress.phase = "idle"

    def run(self, session_of_turn: SessionOfTurn, generate: Generate, interval_s: float,
            stop: Callable[[], None]) -> Iterator[list[GenerationEvent]]:
        """The one turn runner of both faces, called under `exclusive()` or `queued()`: in the model's thread
        (engine_thread.py), pick the turn's session, apply the settings saved since the last turn, and generate;
        the caller gets the events that arrived since it last looked, at most once per `interval_s` (0: as they
        come). A caller that stops iterating calls `stop`, which must end the turn soon. A failure the user
        can act on is raised as UserError; whatever happens, the progress goes back to idle."""
        self.cancel.clear()  # a Stop pressed before this turn is not meant for it

        def in_model_thread() -> Iterator[GenerationEvent]:
            chat = session_of_turn()
            self.settings.apply_pending(self.host.engine, self.store, chat.id)
            yield from self.track(generate(chat, self.start("prefill")))

        try:
            # the turn's last event (its finish reason) goes out at once: the page shows the reply's end before the
            # turn is saved, not after
            updates = self.model_thread.paced(in_model_thread(), interval_s, stop,
                                              urgent=lambda event: event.finish_reason is not None)
            with contextlib.closing(updates):  # a face that goes away stops the turn and waits for it
                yield from updates
        except (SessionError, ContextOverflowError, ConfigError) as error:
            raise UserError(str(error)) from None
        finally:
            self.idle()
