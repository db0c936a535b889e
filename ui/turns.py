"""One generation at a time, for the page and the API alike: the lock, the API's bounded queue, Stop, progress,
and the one thread the model runs in (engine_thread.py).

    turns = TurnRunner()
    with turns.exclusive():                      # the page: UserError(BUSY) when a reply is being generated
        on_prefill = turns.start("prefill")
        for event in turns.track(generate(...)): ...
    with turns.queued(client_gone, max_waiting): # the API: waits its turn, QueueFull past the bound
        ...
    turns.model_thread.call(restore, ...)         # model work runs in that thread, started under the lock
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from infinigen_core import GenerationEvent

from .engine_thread import model_thread
from .errors import BUSY, Abandoned, QueueFull, UserError

WAIT_POLL_S = 0.2  # how often a waiting API request looks whether its client went away


@dataclass
class TurnProgress:
    """What the UI shows while a turn runs."""

    phase: str = "idle"  # idle | restore | prefill | generating
    done: int = 0
    total: int = 0
    started: float = 0.0
    tokens: int = 0
    first_token_at: float | None = None

    def tokens_per_second(self) -> float:
        if self.first_token_at is None or self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / max(time.perf_counter() - self.first_token_at, 1e-9)


class EitherSet:
    """A cancel flag that is set when any of its events is: the API client going away, the page's Stop button."""

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self._events)


class TurnRunner:
    """The engine runs one turn at a time; the page is refused while one runs, API requests queue up to a bound."""

    def __init__(self) -> None:
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
            self.progress.tokens += 1 if event.finish_reason is None else 0
            yield event

    def idle(self) -> None:
        self.progress.phase = "idle"
