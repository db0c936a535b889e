"""Moving selected pool rows to the compute device.

On the CPU the pool already is on the compute device, so a fetch is one gather. With CUDA the pool sits
in pinned host memory: a worker thread waits for the selection (an event, never a device-wide sync),
gathers the rows on the host and copies them on a side stream; the layer that needs them makes the
compute stream wait for that copy's event, so the transfer overlaps the previous layer's work.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .kv_pool import KVPool


@dataclass
class FetchedRows:
    keys: torch.Tensor  # [kv_heads, k, dim] on the compute device
    values: torch.Tensor
    wait_ms: float


class PendingFetch:
    def __init__(self, future: Future | None = None, ready: tuple | None = None, event=None) -> None:
        self._future, self._ready, self._event = future, ready, event

    def wait(self) -> FetchedRows:
        started = time.perf_counter()
        if self._future is not None:
            keys, values, event = self._future.result()
            compute = torch.cuda.current_stream()
            compute.wait_event(event)
            # allocated on the copy stream, read on the compute stream: tell the caching allocator, or it
            # may hand the memory back to the copy stream while attention still reads it
            keys.record_stream(compute)
            values.record_stream(compute)
        else:
            keys, values = self._ready
        return FetchedRows(keys, values, (time.perf_counter() - started) * 1e3)


class Fetcher:
    def __init__(self, pool: KVPool, compute_device: torch.device) -> None:
        self.pool = pool
        self.device = compute_device
        self.asynchronous = compute_device.type == "cuda" and pool.device.type == "cpu"
        if self.asynchronous:
            self._stream = torch.cuda.Stream(device=compute_device)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-fetch")
        self.bytes_fetched = 0

    def start(self, layer: int, slots: torch.Tensor) -> PendingFetch:
        row_bytes = 2 * self.pool.head_dim * torch.empty(0, dtype=self.pool.dtype).element_size()
        self.bytes_fetched += slots.numel() * row_bytes
        if not self.asynchronous:
            keys, values = self.pool.gather(layer, slots)
            return PendingFetch(ready=(keys.to(self.device), values.to(self.device)))
        host_slots = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
        host_slots.copy_(slots, non_blocking=True)
        selected = torch.cuda.Event()
        selected.record()
        return PendingFetch(future=self._worker.submit(self._copy_rows, layer, host_slots, selected))

    def _copy_rows(self, layer: int, host_slots: torch.Tensor, selected: "torch.cuda.Event"):
        selected.synchronize()  # only this event: the selection's indices have reached the host
        keys, values = self.pool.gather(layer, host_slots)
        with torch.cuda.stream(self._stream):
            keys = keys.pin_memory().to(self.device, non_blocking=True)
            values = values.pin_memory().to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return keys, values, copied

    def close(self) -> None:
        if self.asynchronous:
            self._worker.shutdown(wait=True)
