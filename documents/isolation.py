"""Run one conversion in a worker process that the operating system bounds, and kill it when it overruns.

    document = run_bounded(extract_document, (name, data, limits), limits, name)

A thread cannot stop C code (PDFium inflating a 50 MiB stream, the expat parser under mammoth), and memory
that C code takes is invisible to Python's checks, so each conversion gets a process of its own: its address
space may grow by `limits.memory_bytes` (RLIMIT_AS) and its CPU time by `limits.seconds` (RLIMIT_CPU), and
the caller kills it after `limits.seconds` of wall clock. Whatever happens inside, the app's own memory is
untouched and the process's memory returns to the system when it ends.

The processes come from a fork server started once, with the converters already imported, so a conversion
starts in milliseconds rather than the second a fresh interpreter takes; the server is a single-threaded
process of its own, so forking it is safe where forking the app (threads, torch) is not. One conversion runs
at a time: two hostile files at once would cost twice the memory bound.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable

from documents.document import DocumentError
from documents.limits import ConversionLimits

_PRELOADED = ["documents.extract", "pypdfium2", "mammoth"]
_ONE_AT_A_TIME = threading.Lock()


def run_bounded(function: Callable, args: tuple, limits: ConversionLimits, name: str):
    """`function(*args)` in a bounded worker process; its `DocumentError` is raised here as it was there, and
    a worker stopped for memory or time or killed by a crash becomes a `DocumentError` naming `name`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOADED)
    with _ONE_AT_A_TIME:
        receiver, sender = context.Pipe(duplex=False)
        worker = context.Process(target=_work, args=(sender, function, args, limits), daemon=True,
                                 name="document-conversion")
        try:
            worker.start()
            sender.close()
            outcome = _receive(receiver, limits.seconds)
        finally:
            if worker.is_alive():
                worker.kill()
            worker.join()
            receiver.close()
    return _result(outcome, worker.exitcode, limits, name)


def _receive(receiver, seconds: float) -> tuple[str, object] | None:
    if not receiver.poll(seconds):
        return ("timeout", None)
    try:
        return receiver.recv()
    except (EOFError, OSError):  # the worker died before it answered
        return None


def _result(outcome: tuple[str, object] | None, exitcode: int | None, limits: ConversionLimits, name: str):
    memory = f"{limits.memory_bytes // 2**20} MiB"
    if outcome is not None and outcome[0] == "done":
        return outcome[1]
    if outcome is not None and outcome[0] == "refused":
        raise DocumentError(str(outcome[1]))
    if (outcome is not None and outcome[0] == "timeout") or exitcode == -signal.SIGXCPU:
        raise DocumentError(f"{name} took longer than {limits.seconds:g} seconds to convert, the most an attachment "
                            f"may take; it was stopped. Attach a smaller or simpler file (or its text).")
    if outcome is not None and outcome[0] == "memory":
        raise DocumentError(f"{name} needs more than {memory} of memory to convert, the most an attachment may "
                            f"use; it was stopped. Attach a smaller or simpler file (or its text).")
    raise DocumentError(f"{name} could not be converted: the converter stopped on it (it ran out of its {memory} "
                        f"of memory, or the file is damaged). Attach a smaller file, or save it again in another "
                        f"format.")


def _work(sender, function: Callable, args: tuple, limits: ConversionLimits) -> None:
    """In the worker: bound this process, convert, send back what happened."""
    _bound_this_process(limits)
    try:
        outcome: tuple[str, object] = ("done", function(*args))
    except DocumentError as error:
        outcome = ("refused", str(error))
    except MemoryError:
        outcome = ("memory", None)
    except RecursionError:
        outcome = ("failed", None)
    sender.send(outcome)
    sender.close()


def _bound_this_process(limits: ConversionLimits) -> None:
    import resource

    with open("/proc/self/statm") as statm:  # its first figure: the address space now, in pages
        address_space = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    most = address_space + limits.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (most, most))
    cpu = max(1, int(limits.seconds + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind
