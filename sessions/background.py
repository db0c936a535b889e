"""One piece of disk work run beside the model, so a turn's first token does not wait for it.

    pending = BackgroundWrite(lambda: write_chunks(...))
    ...                        # the reply streams meanwhile
    error = pending.wait()     # None once it is on disk; else what went wrong (nothing was raised)

The thread is not a daemon: a process that ends normally finishes the write first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class BackgroundWrite:
    def __init__(self, job: Callable[[], None], name: str = "kv-chunk-write") -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=name)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as error:  # kept for `wait`: the caller decides what a failed write means
            self._error = error

    def wait(self) -> BaseException | None:
        """Block until the job is done; returns its exception, or None when it succeeded."""
        self._thread.join()
        return self._error
