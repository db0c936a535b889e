"""One piece of disk work run beside the model, so a turn's first token does not wait for it.

    pending = BackgroundWrite(lambda: write_chunks(...))
    ...                        # the reply streams meanwhile
    error = pending.wait()     # None once it is on disk; else what went wrong (nothing was raised)

The thread is not a daemon: a process that ends normally finishes the write first. It leaves torch's
thread count alone: `torch.set_num_threads(1)` around the job (tried, to spare the decode the OpenMP pool's
spinning on a small chunk's encode) left the app decoding on ONE core after a long prompt's chunk had been
written (API, default model, 2-core VM, quiet: 18.6 tok/s at 1.06 cores against 29.2 at 1.94 without it).
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

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        """Block until the job is done; returns its exception, or None when it succeeded."""
        self._thread.join()
        return self._error
