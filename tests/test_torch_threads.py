"""Threads other than the model's run torch's parallel loops alone (chat_service/torch_threads.py): their OpenMP
thread count is 1 after `confine_new_threads`, the kept threads' is torch's, and their torch work still runs.
What that buys is measured by scripts/openmp_teams.py, not here."""

from __future__ import annotations

import threading

import pytest
import torch

from chat_service.torch_threads import confine_new_threads, openmp_runtime

runtime = openmp_runtime()
pytestmark = pytest.mark.skipif(runtime is None or torch.get_num_threads() < 2,
                                reason="torch without OpenMP, or one thread: nothing to confine")


def openmp_threads_in(name: str) -> int:
    """The OpenMP thread count a new thread named `name` works with, after one large torch op of its own."""
    seen: list[int] = []

    def work() -> None:
        assert float((torch.ones(1_000_000) * 2).sum()) == 2_000_000.0  # a parallel loop, run where it is
        seen.append(runtime.omp_get_max_threads())

    thread = threading.Thread(target=work, name=name)
    thread.start()
    thread.join()
    return seen[0]


def test_new_threads_run_alone_but_the_kept_ones_keep_torchs_count():
    assert openmp_threads_in("AnyIO worker thread") == torch.get_num_threads()  # as torch starts a thread
    confine_new_threads(keep=("model", "kv-fetch"))
    try:
        assert openmp_threads_in("AnyIO worker thread") == 1
        assert openmp_threads_in("background-chunks") == 1
        assert openmp_threads_in("model") == torch.get_num_threads()
        assert openmp_threads_in("kv-fetch") == torch.get_num_threads()
        assert torch.get_num_threads() >= 2  # torch's own, process-wide setting is left alone
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
