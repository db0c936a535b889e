"""Only the model's threads run torch's parallel loops on every core; each other thread of the app runs them alone.

GNU OpenMP, torch's CPU parallelism, gives every thread that runs a parallel loop a team of helper threads,
kept for as long as that thread lives. Once the process holds more busy teams than cores, every team's
helpers sleep between loops instead of spinning, and the model's decode step, hundreds of short loops a
token, then waits to wake them at each one. One large op on a web worker thread is enough: in a two-core
test a 3M-element sum on another, still-living thread made the model thread's small products 30% slower
(`python scripts/openmp_teams.py`). Gradio's worker threads and the sessions' background writers do such
work now and then (a long conversation's int8 chunk, a panel's figures), so with a long conversation open the
page's replies decoded at half the API's rate (issue 35).

`confine_new_threads()` makes every thread started after it set its own OpenMP thread count to 1 on its first
Python call, except threads named in `keep`: their loops then run inline, with no team. torch's own setting
(`torch.set_num_threads`) is left alone: it is process-wide, and the compiled decode step is built for it.

    confine_new_threads(keep=("model", "model-loader"))
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Iterable

import torch

# the engine's own threads: the decode loop, the first load, and the GPU path's fetch workers
MODEL_THREADS = ("model", "model-loader", "kv-fetch", "cpu-ops")


def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch itself uses (its wheel bundles one under torch/lib), or None where torch runs
    without OpenMP. Another copy of the runtime would hold its own, unrelated settings."""
    if not torch.backends.openmp.is_available():
        return None
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = sorted(glob.glob(os.path.join(folder, "libgomp*.so*")) + glob.glob(os.path.join(folder, "libiomp*")))
    for path in [*candidates, None]:  # None: the process's own symbols (a system runtime torch linked to)
        try:
            runtime = ctypes.CDLL(path)
            runtime.omp_set_num_threads  # noqa: B018  the lookup raises where the symbol is missing
            return runtime
        except (OSError, AttributeError):
            continue
    return None


def run_alone(runtime: ctypes.CDLL) -> None:
    """This thread's torch loops run inline from now on (no team of helpers), whatever torch's setting."""
    torch.get_num_threads()  # torch sets a thread's OpenMP count at its first use: let it, then override that
    runtime.omp_set_num_threads(1)


def confine_new_threads(keep: Iterable[str] = MODEL_THREADS) -> None:
    """Every thread started from now on runs its torch loops alone, except those whose name starts with one of
    `keep`. Uses `threading.setprofile`: the hook runs at a new thread's first call and removes itself."""
    kept = tuple(keep)
    runtime = openmp_runtime()
    if runtime is None:
        return

    def first_call(frame, event, arg) -> None:  # noqa: ARG001
        sys.setprofile(None)
        if not threading.current_thread().name.startswith(kept):
            run_alone(runtime)

    threading.setprofile(first_call)
