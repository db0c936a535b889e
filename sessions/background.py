"""One piece of disk work run beside the model, so a turn's first token does not wait for it.

    pending = BackgroundWrite(lambda: write_chunks(...))
    ...                        # the reply streams meanwhile
    error = pending.wait()     # None once it is on disk; else what went wrong (nothing was raised)

The thread is not a daemon: a process that ends normally finishes the write first. It runs torch on one
intra-op thread: the job's ops are small (a streamed reply's chunk is a few dozen rows), and on torch's
OpenMP pool each of them left the pool's threads spinning, so encoding a 30-token chunk took 110-150 ms of
CPU instead of 5-6 ms, taken from the decode running beside it (a 2-core machine decoded 7-20% slower).
`torch.set_num_threads` sets the calling thread's OpenMP team size (the model's thread keeps its own) and
the default of threads that first use torch meanwhile; it is put back when the job ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

WRITE_THREADS = 1  # torch's intra-op threads for the job (see above)


class BackgroundWrite:
    def __init__(self, job: Callable[[], None], name: str = "kv-chunk-write") -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=name)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(WRITE_THREADS)
        try:
            job()
        except BaseException as error:  # kept for `wait`: the caller decides what a failed write means
            self._error = error
        finally:
            torch.set_num_threads(threads)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        """Block until the job is done; returns its exception, or None when it succeeded."""
        self._thread.join()
        return self._error
