"""The one thread that runs the model.

PyTorch's CPU kernels, and the compiled decode step's, run their parallel loops through OpenMP, and GNU
OpenMP gives every thread that starts such a loop a team of helper threads of its own, kept for as long as
that thread lives. Once a process holds more of them than the machine has cores, every team sleeps instead
of spinning while it waits for work, and each of a decode step's hundreds of parallel loops pays for waking
its helpers: on the 2-core machine, one idle thread that had once run a parallel loop made decoding in
another thread 2x slower (15 ms per token to 30). Gradio runs handlers in a pool of worker threads that its
2-second timer keeps alive, so a page that had restored a session or generated one reply slowed every reply
after it, the API's too (52 tokens/s to 35). The thread that loads the model at start-up ends, and its team
with it.

So whatever runs the model (turns from the page and the API, restoring a session's KV, switching models,
the inspector) runs here, in one long-lived thread per process (`model_thread()`), one job at a time. Jobs
that change what the engine holds are started under the turn lock (turns.py), so the thread is free whenever
the lock is taken.

    thread = model_thread()
    thread.call(open_session, session_id)                         # runs there, waits for the result
    for events in thread.paced(turn_events, 0.25, stop=cancel.set):  # the turn runs on there
        show(events[-1])

`paced` also keeps a page from slowing the model the other way: Gradio calls next() on a streaming handler
and then post-processes and sends each value before it asks for the next, so a reply generated inside
next() would wait for every one of those round trips, and the browser would redraw it once per token. The
turn runs on here and never waits; the page takes what arrived since it last looked, at most once per
`interval_s`.
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class _Handover:
    """What a paced job hands to its consumer, guarded by `changed`'s lock. The consumer is woken by an item
    only while it waits for one (`wanted`) or when the item is urgent, not by each item it gathers until its
    interval is over: a thread woken at every token would take the interpreter's lock from the model's thread
    at every token."""

    def __init__(self, urgent: Callable[[Any], bool] | None = None) -> None:
        self.changed = threading.Condition()
        self.arrived: list = []
        self.wanted = False
        self.urgent, self.hurry = urgent, False  # hurry: an urgent item arrived, the consumer takes it at once
        self.finished = False
        self.error: BaseException | None = None

    def produce(self, items: Iterable) -> None:
        try:
            for item in items:
                with self.changed:
                    self.arrived.append(item)
                    self.hurry = self.hurry or (self.urgent is not None and self.urgent(item))
                    if self.wanted or self.hurry:
                        self.changed.notify()
        except BaseException as error:  # noqa: BLE001  raised again in the consumer's thread
            self.error = error
        finally:
            with self.changed:
                self.finished = True
                self.changed.notify()


class EngineThread:
    def __init__(self, name: str = "model") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # a daemon: a reply being generated never holds the process open at exit
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def here(self) -> bool:
        """Whether the caller runs in this thread (a job that calls `call` or `paced` runs them inline)."""
        return threading.current_thread() is self._thread

    def submit(self, function: Callable[..., T], *args) -> Future:
        """Run `function(*args)` here, after the jobs before it; the caller's context variables go along."""
        future: Future = Future()
        context = contextvars.copy_context()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(context.run(function, *args))
            except BaseException as error:  # noqa: BLE001  the caller gets it from the future
                future.set_exception(error)

        self._jobs.put(job)
        return future

    def call(self, function: Callable[..., T], *args) -> T:
        """`function(*args)` run here; waits for it and returns its result or raises its exception."""
        if self.here():
            return function(*args)
        return self.submit(function, *args).result()

    def paced(self, items: Iterable[T], interval_s: float, stop: Callable[[], None],
              urgent: Callable[[T], bool] | None = None) -> Generator[list[T], None, None]:
        """Iterate `items` here and yield, in the caller's thread, the items that arrived since the last yield
        (a non-empty list, in order): the first at once, the others at most once per `interval_s` (0: as they
        come), the last ones as soon as `items` ends, and an item for which `urgent` is true at once, with those
        before it (a turn's last event: the reply's end shows before the work that follows it, such as the
        turn's save); `urgent` runs in this thread for every item and must not raise. Its exception is raised
        after the items before it.

        Closing this generator early (the page went away) calls `stop`, which must make `items` end soon (a
        turn's cancel flag), and waits for it: the job is over when the close returns.
        """
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, not {interval_s}")
        if self.here():
            yield from ([item] for item in items)
            return
        handover = _Handover(urgent)
        done = self.submit(handover.produce, items)
        last_yield: float | None = None
        try:
            while True:
                with handover.changed:
                    handover.wanted = True
                    handover.changed.wait_for(lambda: handover.arrived or handover.finished)
                    handover.wanted = False
                    if last_yield is not None:  # gather more until the interval is over, unless the job ends
                        remaining = last_yield + interval_s - time.monotonic()
                        if remaining > 0:
                            handover.changed.wait_for(lambda: handover.finished or handover.hurry, timeout=remaining)
                    batch, handover.arrived, handover.hurry = handover.arrived, [], False
                    finished = handover.finished
                if batch:
                    last_yield = time.monotonic()
                    yield batch
                if finished:
                    break
            if handover.error is not None:
                raise handover.error
        finally:
            if not done.done():
                stop()
            done.result()

    def close(self) -> None:
        """End the thread after the jobs already submitted."""
        self._jobs.put(None)


@functools.cache
def model_thread() -> EngineThread:
    """The process's one model thread (OpenMP's teams are the process's, so there is one for all services)."""
    return EngineThread("model")
