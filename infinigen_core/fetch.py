"""Moving KV rows between the pool and the compute device, without making the decode loop wait.

A fetch is started early (InfiniGen: from the previous layer's pre-hook) and waited for when the layer
attends. What `wait` returns always holds the token being decoded as well: selected rows come back with
the new token *first* (so a rank mask over them is the same whether the rows were gathered before or after
the new token was written), a whole layer with the new token in its reserved slot.

- `DirectFetcher`: the pool lives on the compute device (the CPU; `full` on a GPU). A whole layer is the
  pool's own view, selected rows are one gather, done at `wait`, after the new token has been written.
- `StreamFetcher`: the pool lives in host memory and the model on another device. Where `zero_copy` allows
  (zero_copy.py), the compute side writes the new K/V into the pool itself and gathers selected rows straight
  from it: no copy to the host, no host gather, no host round trip (the layers the selected-row cache holds
  keep the worker's path: it tells the cache). Otherwise one worker thread does all
  host-side work in order: it copies new K/V into the pool once their copy to the host has landed, and
  (staged) gathers selected rows into
  double-buffered staging (`index_select(..., out=)`) once their indices have reached the host, then
  copies them up on a side stream. Whole layers (the `offload` baseline and the
  dense layers under sparse policies) are copied contiguously, one layer ahead. The compute side waits for
  a fetch's event, never for the device as a whole. It knows devices only through a
  `transfer.DeviceOps`: `CudaOps` on a GPU (pinned memory, CUDA streams), `ThreadedCpuOps` to run the very
  same ordering on the CPU with delayed copies (tests: `make_fetcher(..., ops=ThreadedCpuOps(delay_s=...))`).

Every copy towards the host in the decode loop goes through `HostChannel.to_host`, which counts them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import devices
from .budget_shares import spread_for
from .kv_pool import KVPool
from .policies.base import selects_rows
from .resident import ResidentLayers, SelectedRowCache
from .transfer import CudaOps, DeviceOps, ThreadedCpuOps, Worker
from .zero_copy import Gathered, MappedRows, refuse_reason_logged, validate

if TYPE_CHECKING:
    from .config import EngineConfig


@dataclass
class FetchedRows:
    keys: torch.Tensor  # [kv_heads, rows, dim] or [kv_heads, 1, rows, dim] on the compute device, new token included
    values: torch.Tensor
    wait_ms: float
    # read in place (CPU kernels): keys/values are the whole layer and `rows` [kv_heads, k + 1] the slots to
    # attend to, the new token's first; None where keys/values are the rows themselves
    rows: torch.Tensor | None = None


class HostChannel:
    """The one way device values travel to the host during decoding: `ops.to_host` (on CUDA a non-blocking
    copy into pinned memory); without ops the values are already there.

    Returns the host tensor and an event to wait on before reading it (None where the copy was immediate).
    """

    def __init__(self, ops: DeviceOps | None) -> None:
        self.ops = ops
        self.copies = 0

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        self.copies += 1
        if self.ops is None:
            return tensor, None
        return self.ops.to_host(tensor)


class PendingFetch:
    """A fetch in flight; `wait` returns the rows with the new token's K/V included."""

    def wait(self, new_keys: torch.Tensor, new_values: torch.Tensor, new_slots: torch.Tensor) -> FetchedRows:
        """new_keys/new_values [kv_heads, n, dim] and new_slots [n] are on the compute device."""
        started = time.perf_counter()
        keys, values, *rows = self._rows(new_keys, new_values, new_slots)
        return FetchedRows(keys, values, (time.perf_counter() - started) * 1e3, *rows)

    def _rows(self, new_keys, new_values, new_slots) -> tuple[torch.Tensor, ...]:
        """(keys, values) of the rows, or (layer keys, layer values, slots) for rows read in place."""
        raise NotImplementedError


def _new_rows_first(new_keys: torch.Tensor, new_values: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetched rows with the new tokens' K/V put first: [kv_heads, n + rows, dim] each."""
    return torch.cat([new_keys, keys], dim=1), torch.cat([new_values, values], dim=1)


class _PoolView(PendingFetch):
    """The whole layer, read in place (the new token is already written to its slot); a sliding layer from its
    window's first slot on (what attention reads of it: rows a restore deferred stay where they are)."""

    def __init__(self, pool: KVPool, layer: int) -> None:
        self.pool, self.layer = pool, layer

    def _rows(self, new_keys, new_values, new_slots):
        first = self.pool.window_start(self.layer)
        return self.pool.keys(self.layer, first), self.pool.values(self.layer, first)


class _GatherAtWait(PendingFetch):
    """Selected rows gathered when the layer attends: its new token is in the pool by then."""

    def __init__(self, pool: KVPool, layer: int, slots: torch.Tensor, on_gather, new_slot_columns) -> None:
        self.pool, self.layer, self.slots = pool, layer, slots
        self.on_gather, self.new_slot_columns = on_gather, new_slot_columns

    def _rows(self, new_keys, new_values, new_slots):
        index = torch.cat([self.new_slot_columns(new_slots), self.slots], dim=1)
        self.on_gather(index.numel())
        heads, rows = index.shape
        return self.pool.gather(self.layer, index, shape=(heads, 1, rows, self.pool.head_dim))


class _RowsInPlace(_GatherAtWait):
    """Selected rows left where they are: attention (the CPU kernels) reads them from the pool by slot (where the
    heads share a budget, `per_head` of the slots each on average: the rows it counts)."""

    def __init__(self, pool: KVPool, layer: int, slots: torch.Tensor, on_gather, new_slot_columns,
                 per_head: int | None) -> None:
        super().__init__(pool, layer, slots, on_gather, new_slot_columns)
        self.per_head = per_head

    def _rows(self, new_keys, new_values, new_slots):
        new_columns = self.new_slot_columns(new_slots)
        index = torch.cat([new_columns, self.slots], dim=1)
        heads, named = self.slots.shape
        self.on_gather(heads * (new_columns.shape[1] + (named if self.per_head is None else self.per_head)))
        return self.pool.keys(self.layer), self.pool.values(self.layer), index


class DirectFetcher:
    """The pool is on the compute device: nothing moves between devices. With `rows_in_place` selected rows
    are not gathered but handed to attention by slot (only where it can read them so: the CPU kernels)."""

    def __init__(self, pool: KVPool, device: torch.device, rows_in_place: bool = False) -> None:
        self.pool, self.device, self.rows_in_place = pool, device, rows_in_place
        self.host = HostChannel(CudaOps(device) if device.type == "cuda" else None)
        self.bytes_fetched = 0
        self._row_bytes = pool.bytes_per_row()
        self._columns_source: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              device_slots: torch.Tensor | None = None) -> None:
        # the pool is on the compute device: the slots' compute-side copy is the same (a step's fixed input buffer
        # on a GPU, step_inputs.py, where `slots` is the pool's new tensor)
        self.pool.write(layer, slots if device_slots is None else device_slots, keys, values)

    def rebuild(self) -> None:
        """The pool's rows changed under the fetcher: nothing here keeps a copy of them."""

    def settle(self) -> None:
        """Writes land at once here: nothing to wait for before a step."""

    def device_bytes(self) -> int:
        return 0

    def start_rows(self, layer: int, slots: torch.Tensor, per_head: int | None = None) -> PendingFetch:
        """The rows `slots` [kv_heads, width] names; `per_head`: the mean a head reads where the heads share a
        budget (policies/infinigen.py), which only rows read in place can take: a gather copies every slot."""
        # a pool that evicts counts every fetch of a row, which its gather does
        if self.rows_in_place and not self.pool.counts_fetches:
            return _RowsInPlace(self.pool, layer, slots, self.count_rows, self._new_slot_columns, per_head)
        return _GatherAtWait(self.pool, layer, slots, self.count_rows, self._new_slot_columns)

    def start_layer(self, layer: int) -> PendingFetch:
        return _PoolView(self.pool, layer)

    def count_rows(self, rows: int) -> None:
        """`rows` rows of K/V read for attention (the decode lane counts its own through here)."""
        self.bytes_fetched += rows * self._row_bytes

    def flush(self) -> None:
        pass

    def _new_slot_columns(self, new_slots: torch.Tensor) -> torch.Tensor:
        """[kv_heads, n] copies of the new tokens' slots; every layer of a step shares them (no eviction)."""
        if new_slots is not self._columns_source:
            self._columns_source = new_slots
            self._columns = new_slots.view(1, -1).expand(self.pool.num_kv_heads, -1)
        return self._columns

    def close(self) -> None:
        pass


class _Streamed(PendingFetch):
    def __init__(self, ops: DeviceOps, future: Future, whole_layer: bool, contiguous_new: int | None) -> None:
        self.ops, self.future = ops, future
        self.whole_layer, self.contiguous_new = whole_layer, contiguous_new

    def _rows(self, new_keys, new_values, new_slots):
        keys, values, copied = self.future.result()
        self.ops.wait(copied, keys, values)
        if not self.whole_layer:
            return _new_rows_first(new_keys, new_values, keys, values)
        # the layer was copied before this step's token was written: put it in its slot on the device
        if self.contiguous_new is not None:
            keys[:, self.contiguous_new : self.contiguous_new + new_keys.shape[1]].copy_(new_keys)
            values[:, self.contiguous_new : self.contiguous_new + new_keys.shape[1]].copy_(new_values)
        else:
            keys.index_copy_(1, new_slots, new_keys)
            values.index_copy_(1, new_slots, new_values)
        return keys, values


class _StreamedThroughCache(PendingFetch):
    """Selected rows put together on the compute device from the cache and the uploaded misses."""

    def __init__(self, ops: DeviceOps, cache: SelectedRowCache, layer: int, future: Future) -> None:
        self.ops, self.cache, self.layer, self.future = ops, cache, layer, future

    def _rows(self, new_keys, new_values, new_slots):
        keys, values, plan, copied, shape = self.future.result()
        self.ops.wait(copied, keys, values, plan)
        keys, values = self.cache.assemble(self.layer, plan, keys, values, shape)
        return _new_rows_first(new_keys, new_values, keys, values)


class _GatheredInPlace(PendingFetch):
    """Selected rows the compute side gathers straight from the pool's memory (zero_copy.py)."""

    def __init__(self, ops: DeviceOps, gathered: Gathered) -> None:
        self.ops, self.gathered = ops, gathered

    def _rows(self, new_keys, new_values, new_slots):
        rows = self.gathered
        self.ops.wait(rows.ready, rows.keys, rows.values)
        keys, values = rows.keys.view(rows.shape), rows.values.view(rows.shape)
        return _new_rows_first(new_keys, new_values, keys, values)


class _ResidentView(PendingFetch):
    """A layer whose rows stay on the compute device (resident.ResidentLayers): nothing to move."""

    def __init__(self, resident: ResidentLayers, layer: int) -> None:
        self.resident, self.layer = resident, layer

    def _rows(self, new_keys, new_values, new_slots):
        return self.resident.rows(self.layer)


class StreamFetcher:
    """The pool is in host memory, the model on a device reached through `ops` (see the module docstring)."""

    def __init__(self, pool: KVPool, ops: DeviceOps, max_rows: int, keep: DeviceKeeping | None = None,
                 zero_copy: bool = False) -> None:
        self.pool, self.ops, self.device = pool, ops, ops.device
        self.host = HostChannel(ops)
        self.bytes_fetched = 0  # K/V rows that crossed to the compute device
        self.plan_bytes = 0  # the selected-row cache's plans that crossed with them
        self._row_bytes = pool.bytes_per_row()
        # The engine's prefill attends over the pool in place when the pool is on the compute device (only
        # with ThreadedCpuOps): there a write of several tokens must have landed before `write` returns.
        self._prefill_reads_pool = pool.device == ops.device
        self._stream = ops.stream()
        self._worker = Worker("kv-fetch")
        self._closed = False
        shape = (2, pool.num_kv_heads, max_rows, pool.head_dim)  # two buffers: one fills while one uploads
        self._staging_keys = ops.host_empty(shape, pool.dtype)
        self._staging_values = ops.host_empty(shape, pool.dtype)
        self._staging_free: list[object | None] = [None, None]
        self._next_staging = 0
        keep = keep or DeviceKeeping()
        self.resident = ResidentLayers(pool, ops, keep.resident_layers)
        self.cache = SelectedRowCache(pool, ops.device, keep.cached_layers, keep.cache_lines)
        self._plan_staging = ops.host_empty((2, 3, pool.num_kv_heads * max_rows), torch.int64) if keep.cache_lines else None
        self._last_write: Future | None = None
        self._written_on_device = False  # rows the compute side wrote into the pool since the last flush
        # selected rows gathered by the compute side in place (zero_copy.py); eviction counts each fetch on
        # the host, so a limited pool keeps the staged path, as the cached layers and host-chosen slots do
        self.zero_copy_reason = self._zero_copy_refused(zero_copy)
        self.mapped = MappedRows(pool, ops, max_rows) if self.zero_copy_reason is None else None

    def _zero_copy_refused(self, wanted: bool) -> str | None:
        """Why selected rows are fetched staged (None: they are gathered in place)."""
        if not wanted:
            return "off (EngineConfig.zero_copy_fetch)"
        if not devices.has_separate_host(self.device):  # ThreadedCpuOps on the plain CPU: the slots are host tensors
            return "the compute device shares the pool's memory: nothing to gather in place"
        if self.pool.counts_fetches:
            return "a limited pool counts every fetch on the host"
        if isinstance(self.ops, CudaOps) and (reason := validate(self.ops, self.pool.dtype, self.pool.head_dim)):
            refuse_reason_logged(reason)
            return reason
        return None

    # -- writes: by the compute side into the pool in place (zero-copy), or device -> host (non-blocking) -> pool,
    #    in the worker once the copy has landed (staged, and the layers the selected-row cache holds)
    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              device_slots: torch.Tensor | None = None) -> None:
        if layer in self.resident:
            self.resident.write(layer, device_slots, keys, values)
        if (self.mapped is not None and layer not in self.cache and device_slots is not None
                and not devices.is_host_tensor(device_slots)):
            self.mapped.write(layer, device_slots, keys, values)
            self._written_on_device = True
            return
        host_keys, _ = self.host.to_host(keys)
        host_values, ready = self.host.to_host(values)  # the later copy on the same stream: both have landed
        written = self._worker.submit(self._write_rows, layer, slots, host_keys, host_values, ready)
        self._last_write = written
        if self._prefill_reads_pool and keys.shape[1] > 1:
            written.result()

    def settle(self) -> None:
        """Before a decode step: the rows the worker wrote so far are in the pool, where the compute side gathers
        in place (zero_copy.py; the rows it wrote itself are ordered before its gathers by the streams). Host
        work only, once per step: the previous step's copies to the host landed when its token was sampled."""
        if self.mapped is not None and self._last_write is not None:
            self._last_write.result()

    def _write_rows(self, layer, slots, host_keys, host_values, ready) -> None:
        if ready is not None:
            ready.synchronize()  # only these copies, in the worker: the decode loop goes on
        self.pool.write(layer, slots, host_keys, host_values)
        self.cache.forget(layer, slots)

    # -- selected rows: indices -> host, gather into staging, upload on the side stream
    def start_rows(self, layer: int, slots: torch.Tensor, per_head: int | None = None) -> PendingFetch:
        """Every slot of `slots` crosses to the compute device (`per_head` is DirectFetcher's: heads share a budget
        only where rows are read in place)."""
        if self.mapped is not None and layer not in self.cache and not devices.is_host_tensor(slots):
            self.bytes_fetched += slots.numel() * self._row_bytes
            return _GatheredInPlace(self.ops, self.mapped.start(layer, slots))
        host_slots, ready = self.host.to_host(slots)
        if ready is None and self._written_on_device:  # slots chosen on the host: the worker reads the pool after
            ready = self.ops.compute_done()            # the rows the compute side wrote into it
        if layer in self.cache:  # the worker counts what crosses: only the misses
            return _StreamedThroughCache(self.ops, self.cache, layer,
                                         self._worker.submit(self._upload_misses, layer, host_slots, ready))
        self.bytes_fetched += slots.numel() * self._row_bytes
        return _Streamed(self.ops, self._worker.submit(self._upload_rows, layer, host_slots, ready), False, None)

    def _upload_rows(self, layer, host_slots, ready):
        if ready is not None:  # None: the slots were chosen in host memory (streaming), nothing to wait for
            ready.synchronize()
        index, self._next_staging = self._next_staging, 1 - self._next_staging
        if self._staging_free[index] is not None:
            self._staging_free[index].synchronize()  # the upload that last read this buffer is done
        # out= needs a contiguous buffer: the front of this one, shaped [kv_heads, k, dim]
        shape = (*host_slots.shape, self.pool.head_dim)
        count = host_slots.numel() * self.pool.head_dim
        staged_keys = self._staging_keys[index].view(-1)[:count].view(shape)
        staged_values = self._staging_values[index].view(-1)[:count].view(shape)
        self.pool.gather(layer, host_slots, out=(staged_keys, staged_values))
        keys = self.ops.empty(shape, self.pool.dtype, self._stream)
        values = self.ops.empty(shape, self.pool.dtype, self._stream)
        self.ops.copy(keys, staged_keys, self._stream)
        self.ops.copy(values, staged_values, self._stream)
        copied = self.ops.record(self._stream)
        self._staging_free[index] = copied
        return keys, values, copied

    def _upload_misses(self, layer, host_slots, ready):
        """The cache's plan for these slots, then only the rows it misses, gathered and uploaded."""
        if ready is not None:
            ready.synchronize()
        plan, pairs = self.cache.plan(layer, host_slots)
        self.pool.count_fetches(layer, host_slots)
        index, self._next_staging = self._next_staging, 1 - self._next_staging
        if self._staging_free[index] is not None:
            self._staging_free[index].synchronize()
        rows, dim = host_slots.numel(), self.pool.head_dim
        staged_keys = self._staging_keys[index].view(-1)[: plan.misses * dim].view(-1, dim)
        staged_values = self._staging_values[index].view(-1)[: plan.misses * dim].view(-1, dim)
        self.pool.gather_pairs(layer, pairs, out=(staged_keys, staged_values))
        staged_plan = self._plan_staging[index].view(-1)[: 3 * rows].view(3, rows)
        staged_plan.copy_(plan.packed)
        keys = self.ops.empty((rows, dim), self.pool.dtype, self._stream)
        values = self.ops.empty((rows, dim), self.pool.dtype, self._stream)
        device_plan = self.ops.empty((3, rows), torch.int64, self._stream)
        if plan.misses:
            self.ops.copy(keys[: plan.misses], staged_keys, self._stream)
            self.ops.copy(values[: plan.misses], staged_values, self._stream)
        self.ops.copy(device_plan, staged_plan, self._stream)
        copied = self.ops.record(self._stream)
        self._staging_free[index] = copied
        self.bytes_fetched += plan.misses * self._row_bytes
        self.plan_bytes += staged_plan.numel() * staged_plan.element_size()
        return keys, values, device_plan, copied, (*host_slots.shape, dim)

    # -- whole layers: contiguous per KV head, one layer ahead (resident layers: already there)
    def start_layer(self, layer: int) -> PendingFetch:
        if layer in self.resident:
            return _ResidentView(self.resident, layer)
        size = self.pool.size()
        if self._written_on_device:  # the upload reads rows the compute side wrote into the pool
            self.ops.follow(self._stream)
        self.bytes_fetched += size * self.pool.num_kv_heads * self._row_bytes
        reserved = self.pool.last_reserved[layer]
        contiguous_new = size - reserved.numel() if self.pool.last_reserved_contiguous else None
        return _Streamed(self.ops, self._worker.submit(self._upload_layer, layer, size), True, contiguous_new)

    def _upload_layer(self, layer, size):
        shape = (self.pool.num_kv_heads, size, self.pool.head_dim)
        keys = self.ops.empty(shape, self.pool.dtype, self._stream)
        values = self.ops.empty(shape, self.pool.dtype, self._stream)
        host_keys, host_values = self.pool.keys(layer), self.pool.values(layer)
        for head in range(shape[0]):  # each head's rows are contiguous in the pool: a true async copy
            self.ops.copy(keys[head], host_keys[head], self._stream)
            self.ops.copy(values[head], host_values[head], self._stream)
        return keys, values, self.ops.record(self._stream)

    def rebuild(self) -> None:
        """The pool's rows changed under the fetcher (a restore, a truncate that moved rows, a release):
        upload the resident layers again and empty the cache (after every pending write has landed)."""
        self.flush()
        self.resident.rebuild()
        self.cache.clear()

    def device_bytes(self) -> int:
        """Compute-device memory the resident layers, the cache and the in-place gathers' buffers hold."""
        return self.resident.bytes() + self.cache.bytes() + (self.mapped.bytes() if self.mapped else 0)

    def pending_host_work(self) -> int:
        """Writes and fetches whose host side has not finished yet."""
        return self._worker.pending

    @property
    def worker_calls(self) -> int:
        """Writes and fetches handed to the worker thread so far (a decode step on the GPU makes none where it
        writes and gathers in place)."""
        return self._worker.submitted

    def flush(self) -> None:
        """Wait until every write and fetch started so far has been done on the host side, and every copy
        they enqueued has run (the in-place gathers too): a truncate or a restore after a flush may overwrite pool rows that a copy
        to the device was still reading (on a GPU the last step's DMAs need not have finished)."""
        if not self._closed:
            self._worker.submit(lambda: None).result()
            if self._written_on_device:  # the rows the compute side wrote into the pool have landed
                self.ops.compute_done().synchronize()
                self._written_on_device = False
            self.ops.record(self._stream).synchronize()
            if self.mapped is not None:  # the in-place gathers still reading the pool
                self.ops.record(self.mapped.stream).synchronize()

    def close(self) -> None:
        """Stop the worker and the streams, waiting a bounded time. A fetch in flight either completes or
        fails with RuntimeError when waited on; writes already started still land. Never raises."""
        if self._closed:
            return
        self._closed = True
        streams_stopped = self.ops.close()  # cuts copy delays short first: the worker may be waiting on one
        self._worker.stop()
        if not (self._worker.join() and streams_stopped):
            warnings.warn("a KV fetch thread did not stop in time and was left behind", RuntimeWarning, stacklevel=2)


@dataclass(frozen=True)
class DeviceKeeping:
    """What a streamed fetcher keeps on the compute device (resident.py): the layers kept whole there, and
    the sparse layers whose selected rows are cached, `cache_lines` rows per KV head (0: no cache)."""

    resident_layers: frozenset[int] = frozenset()
    cached_layers: frozenset[int] = frozenset()
    cache_lines: int = 0

    def __post_init__(self) -> None:
        if not self.cache_lines:
            object.__setattr__(self, "cached_layers", frozenset())

    @staticmethod
    def for_policy(policy, adapter, config) -> DeviceKeeping:
        """What `policy` keeps on the device under `config` (EngineConfig) for a model (arch.ModelAdapter): the
        layers `resident_layer_set` names, over the model's whole context, and the cache of selected rows in the
        layers the policy selects in; `full` keeps the whole pool there anyway (a DirectFetcher)."""
        layers = range(adapter.num_layers)
        selecting = frozenset(layer for layer in layers if policy.is_sparse(layer))
        skew_set = policy.ctx.skew_set  # InfiniGen's budget shares, which size its gathers (budget_shares.py)
        shares = spread_for(config, skew_set.attention_curves if skew_set is not None else None, sorted(selecting))
        resident = resident_layer_set(policy.name, [adapter.is_global(layer) for layer in layers], config,
                                      adapter.head_dim, adapter.max_context, max(shares.values(), default=1.0))
        return DeviceKeeping(resident, selecting, config.selected_rows_cache)


def resident_layer_set(policy: str, global_layers: Sequence[bool], config: EngineConfig, head_dim: int,
                       context: int, widest_share: float = 1.0) -> frozenset[int]:
    """The layers whose K/V a streamed fetcher keeps whole on the compute device under `config`, for a model
    whose layers are global or not (`global_layers`) and a context of `context` tokens. Pure: the engine
    (DeviceKeeping.for_policy) and the GPU predictor (bench/gpu_predict.py) both read it.

    Nothing without `dense_layers_on_device`, nor for `full` (its whole pool is on the device). A sparse
    policy keeps the layers it reads whole: the dense first layers and the sliding-window layers. `offload`,
    the fair baseline (FlexGen's users keep resident whatever fits), keeps as many whole layers as fit in the
    device memory InfiniGen's KV-side state takes under the same `config` over `context` tokens: its resident
    layers, its partial keys (partial_ratio of every selecting layer's keys), its two gather buffers
    (zero_copy.MappedRows, each as wide as its widest layer's gather: `widest_share` times
    `budget_tokens_for(context)`, plus 1, where the budget is spread over the layers) and the selected-row cache;
    InfiniGen's resident layers first, then the others in order."""
    if not config.dense_layers_on_device or policy == "full":
        return frozenset()
    selecting = [selects_rows(layer, config.dense_layers, is_global) for layer, is_global in enumerate(global_layers)]
    read_whole = [layer for layer, selects in enumerate(selecting) if not selects]
    if policy != "offload":
        return frozenset(read_whole)
    # in whole layers of `context` tokens (K and V of every KV head; the partial keys have the pool's dtype
    # wherever the pool is apart from the compute device)
    partial_keys = max(1, int(round(config.partial_ratio * head_dim))) / (2 * head_dim)  # per selecting layer
    zero_copy = config.zero_copy_fetch and config.pool_limit_tokens is None
    widest = min(context, int(widest_share * config.budget_tokens_for(context) + 1e-9))  # as InfiniGen's budget_for
    buffer_rows = 2 * (widest + 1) if zero_copy else 0
    cache_rows = sum(selecting) * config.selected_rows_cache
    fits = int(len(read_whole) + sum(selecting) * partial_keys + (buffer_rows + cache_rows) / context)
    order = read_whole + [layer for layer, selects in enumerate(selecting) if selects]
    return frozenset(order[:fits])


def make_fetcher(pool: KVPool, device: torch.device, max_rows: int, ops: DeviceOps | None = None,
                 rows_in_place: bool = False, keep: DeviceKeeping | None = None, zero_copy: bool = False):
    """The fetcher for a pool and a compute device; `ops` forces the streamed pipeline over those device
    operations (tests run it on the CPU with `transfer.ThreadedCpuOps`); `rows_in_place` asks a pool on the
    compute device to hand selected rows over by slot (attention reads them with the CPU kernels); `zero_copy`
    lets a streamed fetcher's compute side gather selected rows from the pool in place (zero_copy.py)."""
    if ops is not None:
        return StreamFetcher(pool, ops, max_rows, keep, zero_copy)
    if device.type == "cuda" and pool.device.type == "cpu":
        return StreamFetcher(pool, CudaOps(device), max_rows, keep, zero_copy)
    if devices.is_emulated(device) and pool.device != device:  # CUDA's pipeline, its copies run by threads
        return StreamFetcher(pool, ThreadedCpuOps(device=device), max_rows, keep, zero_copy)
    return DirectFetcher(pool, device, rows_in_place)
