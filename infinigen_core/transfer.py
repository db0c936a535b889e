"""Copies between the compute device and host memory, ordered by streams and events, behind one small interface.

The fetch pipeline (`fetch.StreamFetcher`) decides *what* moves and in which order; a `DeviceOps` decides
what a copy, a stream and an event are:

- `CudaOps`: CUDA side streams and events, pinned host staging. Nothing in it makes the host wait except
  an event's `synchronize()`, which only the fetch worker, a flush (and the stats reader) call, and `close`.
- `ThreadedCpuOps`: the same ordering on the CPU, so the pipeline runs and is tested without a GPU. Each
  stream is a thread that runs its copies in order, each after an injectable delay; an event is set once
  every copy enqueued on its stream before it has run. The compute side is the calling thread, so its
  `wait` blocks. Buffers it hands out are poisoned (NaN, or -1 for integers) until a copy fills them, so
  a read that skips a wait shows up as wrong numbers instead of passing by luck. The compute side's writes
  into mapped host memory (`scatter`) land late too, on the thread of its copies towards the host, as a
  kernel's writes land in its stream's order: whatever reads the pool must be ordered after them.

>>> ops = ThreadedCpuOps(delay_s=0.001)
>>> side = ops.stream()
>>> dst = ops.empty((2,), torch.float32, side)
>>> ops.copy(dst, torch.ones(2), side)
>>> ops.wait(ops.record(side), dst)
>>> dst.tolist()
[1.0, 1.0]
>>> ops.close()
True
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from . import devices

CLOSE_TIMEOUT_S = 5.0  # a closing thread that has not finished by then is left behind (daemon), never waited on


class Event(Protocol):
    """A point in a stream's work: `synchronize` makes the calling host thread wait until it is reached."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DeviceOps(Protocol):
    """What the fetch pipeline needs from a device (see the module docstring)."""

    device: torch.device  # where fetched rows end up (the compute device)

    def stream(self) -> object:
        """A new side stream: copies enqueued on it run in order, concurrently with the compute side."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory a copy to the device can read asynchronously (pinned on CUDA)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, stream: object) -> torch.Tensor:
        """Device memory to be filled by copies on `stream`."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        """Enqueue `dst.copy_(src)` on `stream`; returns at once."""

    def record(self, stream: object) -> Event:
        """An event reached once everything enqueued on `stream` so far has run."""

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """A copy of a compute-side tensor as it is now, landing in host memory; read it after the event."""

    def wait(self, event: Event, *tensors: torch.Tensor) -> None:
        """The compute side goes on only once `event` is reached; `tensors` (filled on a side stream) are
        then read by the compute side."""

    def mapped(self, host: torch.Tensor) -> torch.Tensor:
        """A compute-side view of contiguous host memory that gathers read in place (on CUDA: pinned memory
        over UVA, zero-copy); valid while `host` lives, written only by `scatter`."""

    def scatter(self, target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Enqueue `target.index_copy_(0, index, rows)` on the compute side (target: a `mapped` view; index and
        rows compute tensors): the compute device writes rows into host memory where they lie; returns at once."""

    def compute_done(self) -> Event:
        """An event reached once the compute side's work enqueued so far (its `scatter`s too) has run."""

    def follow(self, stream: object) -> None:
        """Work enqueued on `stream` from now on runs after the compute side's work enqueued so far (its
        `scatter`s too)."""

    def gather(self, stream: object, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """Enqueue `index_select(source, 0, index, out=out)` on `stream` (source: a `mapped` view); returns at once."""

    def close(self) -> bool:
        """Stop the streams (what was enqueued still runs, without delays); later copies raise.
        Returns whether every stream stopped in time."""


class Worker:
    """One daemon thread running submitted calls in order: a one-thread executor whose close has a time
    limit, so a stuck call can never hang the program (or its exit)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # a call is either queued before the stop marker or refused
        self._stopped = False
        self._pending = 0  # calls submitted and not finished
        self.submitted = 0  # calls submitted so far
        # under the separate-devices check the thread keeps the same rules as the thread that made it
        self._mode = devices.active_mode()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        """Queue `fn(*args)`; raises RuntimeError once stopped (a call queued then would never run)."""
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._thread.name} is closed")
            self._calls.put((future, fn, args))
            self._pending += 1
            self.submitted += 1
        return future

    @property
    def pending(self) -> int:
        """Calls submitted that have not finished yet."""
        return self._pending

    def _run(self) -> None:
        with devices.entered(self._mode):
            self._run_calls()

    def _run_calls(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args = item
            try:
                self._call(future, fn, args)
            finally:
                with self._lock:
                    self._pending -= 1

    @staticmethod
    def _call(future: Future, fn: Callable, args) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():  # the pool's tensors are inference tensors
                result = fn(*args)
        except BaseException as error:  # kept for whoever waits on the future; never leaks from the thread
            future.set_exception(error)
        else:
            future.set_result(result)

    def stop(self) -> None:
        """Run what was submitted so far, then end."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._calls.put(None)

    def join(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Returns whether the thread has ended (waiting at most `timeout`)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


# ---------------------------------------------------------------------------------------------- CUDA
class CudaOps:
    """CUDA streams and events; staging in pinned host memory (see the module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def empty(self, shape, dtype, stream) -> torch.Tensor:
        with torch.cuda.stream(stream):  # allocated on the stream that fills it (see `wait`)
            return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, dst, src, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def to_host(self, tensor):
        if tensor.device.type == "cpu":
            return tensor, None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        return host, ready

    def wait(self, event, *tensors) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)  # the compute stream waits, the host does not
        for tensor in tensors:  # allocated on a side stream, read on the compute stream: tell the allocator
            tensor.record_stream(compute)

    def mapped(self, host) -> torch.Tensor:
        if not (host.is_pinned() and host.is_contiguous()):
            raise ValueError("a CUDA view of host memory needs contiguous pinned memory")
        # Under unified addressing pinned memory has the same address on the device: a CUDA tensor over it
        # (bytes, then the dtype: the array interface knows no bfloat16). Validated once per fetcher
        # (zero_copy.validate), never assumed.
        size = host.numel() * host.element_size()
        raw = torch.as_tensor(_DeviceBytes(host.data_ptr(), size), device=self.device)
        return raw.view(host.dtype).view(host.shape)

    def scatter(self, target, index, rows) -> None:
        target.index_copy_(0, index, rows)  # a kernel on the compute stream, writing over UVA into pinned memory

    def compute_done(self) -> torch.cuda.Event:
        return self.record(torch.cuda.current_stream(self.device))

    def follow(self, stream) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def gather(self, stream, source, index, out) -> None:
        with torch.cuda.stream(stream):
            torch.index_select(source, 0, index, out=out)
        index.record_stream(stream)  # made on the compute stream, read on this one

    def close(self) -> bool:
        # what the streams enqueued still runs: kernels that read or write the pool's pinned memory through a mapped
        # view (`gather`, `scatter`) are unknown to the host allocator, so they finish before the pool goes
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as error:  # a sticky CUDA error: closing never raises (StreamFetcher.close), it says so
            warnings.warn(f"the GPU reported an error while the KV fetch closed: {error}", RuntimeWarning, stacklevel=2)
        return True


class _DeviceBytes:
    """`size` bytes at a device-accessible address, as torch.as_tensor reads them (CUDA array interface v3)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


# ---------------------------------------------------------------------------------------------- CPU
class _CpuEvent:
    def __init__(self, reached: Future) -> None:
        self._reached = reached

    def synchronize(self) -> None:
        self._reached.result()

    def query(self) -> bool:
        return self._reached.done()


class _CpuStream:
    def __init__(self, name: str) -> None:
        self.worker = Worker(name)
        self.error: BaseException | None = None  # the first failed copy: every later event raises it (as CUDA's sticky errors)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a copy on this stream failed: {self.error!r}") from self.error


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)


class ThreadedCpuOps:
    """Streams as threads, events as futures, every copy after `delay_s` (seconds, or a function returning
    them, called once per copy in the stream's thread: jitter). See the module docstring.

    `device` is the compute device: the plain CPU, or `devices.EMULATED_COMPUTE`, where buffers are made on
    the emulated host and compute devices and a host tensor's `to_host` is immediate, as on CUDA."""

    def __init__(self, delay_s: float | Callable[[], float] = 0.0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._host_device = devices.host_device_for(self.device)
        self.delay_s = delay_s
        self.copies = 0  # copies run so far, on every stream
        self._counting = threading.Lock()
        self._stopping = threading.Event()  # cuts every delay short
        self._streams: list[_CpuStream] = []
        self._compute_to_host = self.stream("cpu-ops-to-host")  # the copies a compute stream enqueues towards the host
        self._last_scatter: Future | None = None  # the compute side's last write into host memory

    def stream(self, name: str | None = None) -> _CpuStream:
        """A stream's thread is named after it, so a delay function can tell streams apart."""
        stream = _CpuStream(name or f"cpu-ops-stream-{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return _poisoned(shape, dtype, self._host_device)

    def empty(self, shape, dtype, stream) -> torch.Tensor:
        return _poisoned(shape, dtype, self.device)

    def copy(self, dst, src, stream) -> None:
        stream.worker.submit(self._copy, dst, src, stream)  # raises once closed

    def _copy(self, dst, src, stream) -> None:
        self._late(stream, self._cross, dst, src)
        with self._counting:
            self.copies += 1

    @staticmethod
    def _cross(dst, src) -> None:
        with devices.crossing():
            dst.copy_(src)

    def _late(self, stream, work: Callable, *args) -> None:
        """On `stream`'s worker: `work(*args)` after the transfer delay; its error is kept for `stream.check`."""
        delay = self.delay_s() if callable(self.delay_s) else self.delay_s
        if delay > 0:
            self._stopping.wait(delay)
        try:
            work(*args)
        except Exception as error:
            stream.error = stream.error or error

    def record(self, stream) -> _CpuEvent:
        try:
            return _CpuEvent(stream.worker.submit(stream.check))
        except RuntimeError:  # closed: everything enqueued has run (or was left behind)
            reached: Future = Future()
            reached.set_result(None)
            return _CpuEvent(reached)

    def to_host(self, tensor):
        if devices.is_emulated(self.device) and devices.side_of(tensor) == devices.HOST:
            return tensor, None  # already in host memory: as CudaOps, nothing to copy and no event
        # A compute stream's copy reads the tensor at its place in the stream, i.e. as it is now; only its
        # arrival is late. Snapshot now, deliver after the delay.
        snapshot = tensor.detach().clone()
        host = _poisoned(snapshot.shape, snapshot.dtype, self._host_device)
        self.copy(host, snapshot, self._compute_to_host)
        return host, self.record(self._compute_to_host)

    def wait(self, event, *tensors) -> None:
        event.synchronize()  # the compute side is this thread

    def mapped(self, host) -> torch.Tensor:
        return devices.mapped_view(host)

    def scatter(self, target, index, rows) -> None:
        # the compute stream's write lands late, as a kernel's: on the thread of its copies to the host, in
        # order with them (a `to_host` event after it is reached only once it has landed); the values as they
        # are now (a snapshot: the compute side may reuse their memory, which a stream's order would forbid)
        self._last_scatter = self._compute_to_host.worker.submit(
            self._late, self._compute_to_host, self._scatter, target, index.detach().clone(), rows.detach().clone())

    @staticmethod
    def _scatter(target, index, rows) -> None:
        target.index_copy_(0, index, rows)  # a write through a mapped view: the mode allows it without a crossing

    def compute_done(self) -> _CpuEvent:
        return self.record(self._compute_to_host)

    def follow(self, stream) -> None:
        # the compute side is this thread: what it computed has run; its writes to host memory may not have
        if self._last_scatter is not None:
            self._last_scatter.result()
            self._compute_to_host.check()

    def gather(self, stream, source, index, out) -> None:
        stream.worker.submit(self._late, stream, self._gather, source, index, out)

    @staticmethod
    def _gather(source, index, out) -> None:
        torch.index_select(source, 0, index, out=out)  # a mapped read: the mode allows it without a crossing

    def close(self) -> bool:
        self._stopping.set()
        for stream in self._streams:
            stream.worker.stop()
        return all([stream.worker.join() for stream in self._streams])
