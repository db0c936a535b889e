"""Selected rows read by the compute device straight from the pool in host memory: no host gather, no staging,
no host round trip (ShadowKV's and ParisKV's way, our own code); and the new tokens' rows written into it the
same way.

On CUDA the pool is pinned, and pinned memory is mapped into the GPU's address space under unified
addressing: `CudaOps.mapped` makes a CUDA tensor over a layer's flat [kv_heads * capacity, dim] rows, and
torch's own `index_select` on its own side stream gathers the selected rows from it over PCIe. The indices are
computed on the device (slot + the head's offset) and never leave it; the compute stream waits for the
gather's event, the host for nothing. Under INFINIGEN_SEPARATE_DEVICES the same code runs on the CPU over
`devices.mapped_view`, which the checking mode lets the compute side gather from and write its own rows into,
and nothing else.

    rows = MappedRows(pool, ops, max_rows)
    rows.write(layer, new_slots, keys, values)  # new rows [kv_heads, n, dim] into slots [n], on the compute stream
    gathered = rows.start(layer, slots)       # slots [kv_heads, k] on the compute device; returns at once
    ops.wait(gathered.ready, gathered.keys, gathered.values)   # the compute side reads them after this

What keeps it exact:
- the pool's new rows are written by the compute side itself (`write`, an `index_copy_` through the view on
  the compute stream: no copy to the host, no fetch worker, no event), and every gather waits for the compute
  stream first (`follow`), so a gather never overtakes a write. What reads the pool elsewhere is ordered
  after them too: a whole layer's upload follows the compute stream, a flush waits for it (before the host
  reads, truncates, saves or grows the pool). The token being decoded is never gathered: it comes first,
  from the compute side;
- a pool that reallocates (growth, release) gets new views before the next gather (`_views_for`);
  growth and release happen only after a flush, which waits for the gathers in flight on their stream and
  for the compute side's writes;
- the gathers have a stream of their own: it waits for the compute stream before each gather (the indices
  are computed there), which must not hold up the whole-layer uploads on the fetcher's stream;
- two output buffers per fetcher, each [kv_heads * max_rows, dim], used in turn: a layer's rows are
  consumed (concatenated after the new token) before the buffer comes round again, in stream order.

`validate` runs once per fetcher on CUDA: a small pinned probe gathered through a view and the staged
way must agree, and two rows written through the view must land in it, or the fetch stays staged with the
reason logged.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from .kv_pool import KVPool
from .pool_lifecycle import PoolStorage
from .transfer import DeviceOps

log = logging.getLogger(__name__)


class MappedRows:
    """Gathers of selected rows from mapped views of the pool (see the module docstring)."""

    def __init__(self, pool: KVPool, ops: DeviceOps, max_rows: int) -> None:
        self.pool, self.ops = pool, ops
        self.stream = ops.stream()  # its own: `follow` makes it wait for the compute stream
        shape = (2, pool.num_kv_heads * max_rows, pool.head_dim)
        self._keys = ops.empty(shape, pool.dtype, self.stream)
        self._values = ops.empty(shape, pool.dtype, self.stream)
        self._next = 0
        # the pool storage the views were made over, weakly: a pool that reallocates, or one given back
        # (release_spare, configure, close), frees its old (pinned) storage at once
        self._source: weakref.ref[PoolStorage] | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._offsets: torch.Tensor | None = None

    def _views_for(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        storage = self.pool.storage
        if self._source is None or self._source() is not storage:  # first use, or the pool reallocated
            self._views = [(self.ops.mapped(store.flat_keys), self.ops.mapped(store.flat_values))
                           for store in storage.layers]
            self._offsets = storage.head_offsets.to(self.ops.device)
            self._source = weakref.ref(storage)
        return self._views[layer]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write new rows [kv_heads, n, dim] into slots [n] (compute device) of `layer`, where they lie in the pool,
        on the compute stream."""
        keys_view, values_view = self._views_for(layer)
        # [kv_heads * n], row-major over (head, token); made from the slots' values every time (no cache keyed on
        # the tensor: a step whose inputs sit in fixed buffers, as a captured one's must, refills the same tensor)
        rows = (slots.view(1, -1) + self._offsets).view(-1)
        dim, dtype = self.pool.head_dim, self.pool.dtype
        self.ops.scatter(keys_view, rows, keys.to(dtype).reshape(-1, dim))
        self.ops.scatter(values_view, rows, values.to(dtype).reshape(-1, dim))

    def start(self, layer: int, slots: torch.Tensor) -> Gathered:
        """Gather the rows of `slots` [kv_heads, k] (compute device) on the side stream."""
        keys_view, values_view = self._views_for(layer)
        rows = (slots + self._offsets).view(-1)
        index, self._next = self._next, 1 - self._next
        count = rows.numel()
        keys, values = self._keys[index, :count], self._values[index, :count]
        self.ops.follow(self.stream)  # the indices were computed on the compute side
        self.ops.gather(self.stream, keys_view, rows, keys)
        self.ops.gather(self.stream, values_view, rows, values)
        return Gathered(self.ops.record(self.stream), keys, values, (*slots.shape, self.pool.head_dim))

    def bytes(self) -> int:
        return 2 * self._keys.numel() * self._keys.element_size()


@dataclass(frozen=True)
class Gathered:
    """Rows being gathered: [kv_heads * k, dim] each, to be read as `shape` once `ready` is reached."""

    ready: object
    keys: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]


def validate(ops: DeviceOps, dtype: torch.dtype, head_dim: int) -> str | None:
    """Whether gathers through a mapped view give what the staged path gives, and rows written through it land in
    host memory: None, or why not (a probe of 64 rows in host memory from `ops.host_empty`, pinned on CUDA)."""
    try:
        host = ops.host_empty((64, head_dim), dtype)
        host.copy_(torch.randn(64, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype))
        index_host = torch.tensor([5, 0, 63, 17, 17, 40])
        staged = host.index_select(0, index_host).to(ops.device)
        stream = ops.stream()
        out = ops.empty((index_host.numel(), head_dim), dtype, stream)
        view = ops.mapped(host)
        ops.follow(stream)
        ops.gather(stream, view, index_host.to(ops.device), out)
        ops.wait(ops.record(stream), out)
        same = bool(torch.equal(out, staged))
        written = torch.randn(2, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
        ops.scatter(view, torch.tensor([3, 60]).to(ops.device), written.to(ops.device))
        ops.compute_done().synchronize()
        landed = bool(torch.equal(host[[3, 60]], written))
    except Exception as error:  # any failure of the view: the staged fetch serves
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}"
    if not same:
        return "rows gathered through the mapped view differ from the staged path's"
    return None if landed else "rows written through the mapped view did not land in host memory"


def refuse_reason_logged(reason: str) -> None:
    log.warning("selected rows are fetched staged (gathered on the host, then copied): the zero-copy view failed "
                "its check: %s", reason)
