"""What the compute device keeps between steps when the pool lives in host memory (a GPU; its emulation).

Two kinds of K/V never need to cross the link again once they are on the compute device:

- `ResidentLayers`: the layers that read every row at every step (the dense first layers and the
  sliding-window layers under a sparse policy). Fetching them whole each step is FlexGen's cost; instead
  their new K/V are written on the compute device as the model computes them (the pool in host memory still
  gets its copy, for sessions), so a decode step moves only the sparse layers' selected rows. Rebuilt from
  the pool (one upload) whenever the pool's rows change under them (a restore, a truncate that moved rows,
  a settings change over a filled pool).
- `SelectedRowCache`: per sparse layer, the rows fetched lately, direct-mapped by slot (line = slot mod
  `lines`, per KV head). The fetch worker keeps the directory in host memory (it already holds the
  selected slots there), gathers and uploads only the rows that miss, and sends a small plan: for every
  selected row, where on the compute device it is (a cache line or the uploaded rows), and which cache line
  each uploaded row replaces. The compute side follows the plan with fixed-shape gathers, so no shape
  depends on how many rows hit. A slot written again (a truncate, an eviction) drops out of the directory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_pool import KVPool
from .transfer import DeviceOps


class ResidentLayers:
    """Compute-side K/V of `layers` (see the module docstring); slot-indexed as the pool."""

    def __init__(self, pool: KVPool, ops: DeviceOps, layers: frozenset[int]) -> None:
        self.pool, self.ops, self.layers = pool, ops, layers
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self.rebuild()

    def __contains__(self, layer: int) -> bool:
        return layer in self.layers

    def rebuild(self) -> None:
        """Upload every resident layer's rows in use from the pool (call with no write in flight)."""
        if not self.layers:
            return
        stream = self.ops.stream()
        size = self.pool.size()
        for layer in self.layers:
            self._keys[layer], self._values[layer] = self._empty(self.pool.capacity)
            for target, source in ((self._keys[layer], self.pool.keys(layer)), (self._values[layer], self.pool.values(layer))):
                for head in range(self.pool.num_kv_heads):  # each head's rows are contiguous in the pool
                    self.ops.copy(target[head, :size], source[head], stream)
        self.ops.wait(self.ops.record(stream), *self._keys.values(), *self._values.values())

    def _empty(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.pool.num_kv_heads, capacity, self.pool.head_dim)
        device = self.ops.device
        return torch.empty(shape, dtype=self.pool.dtype, device=device), torch.empty(shape, dtype=self.pool.dtype, device=device)

    def write(self, layer: int, device_slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New K/V [kv_heads, n, dim] of `device_slots` (compute device), as the pool gets them."""
        if self._keys[layer].shape[1] < self.pool.capacity:  # the pool grew: grow on the device, no crossing
            grown_keys, grown_values = self._empty(self.pool.capacity)
            held = self._keys[layer].shape[1]
            grown_keys[:, :held].copy_(self._keys[layer])
            grown_values[:, :held].copy_(self._values[layer])
            self._keys[layer], self._values[layer] = grown_keys, grown_values
        self._keys[layer].index_copy_(1, device_slots, keys.to(self.pool.dtype))
        self._values[layer].index_copy_(1, device_slots, values.to(self.pool.dtype))

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's rows in use, the new token's included (written before the layer attends)."""
        size = self.pool.size()
        return self._keys[layer][:, :size], self._values[layer][:, :size]

    def bytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in self._keys.values())


@dataclass
class RowPlan:
    """How one fetch's rows come together on the compute device (built by the worker, uploaded with the rows).

    All [kv_heads * k] int64, row-major over (head, rank): `from_cache` the flat cache line of a hit or -1,
    `from_upload` the uploaded row of a miss or -1, `store_at` the flat cache line an uploaded row replaces
    (the cache's scratch line where two misses want the same line: one of them is kept)."""

    packed: torch.Tensor  # [3, kv_heads * k]: from_cache, from_upload, store_at
    misses: int


class SelectedRowCache:
    """Direct-mapped compute-side cache of selected rows, `lines` per KV head, per sparse layer."""

    def __init__(self, pool: KVPool, device: torch.device, layers: frozenset[int], lines: int) -> None:
        self.pool, self.device, self.layers, self.lines = pool, device, layers, lines
        heads = pool.num_kv_heads
        # the directory (host memory, the fetch worker's): which slot each line holds, -1 none
        self._tags = {layer: torch.full((heads, lines), -1, dtype=torch.int64) for layer in layers}
        shape = (heads * lines + 1, pool.head_dim)  # the last line is scratch: where a duplicate miss goes
        self._keys = {layer: torch.zeros(shape, dtype=pool.dtype, device=device) for layer in layers}
        self._values = {layer: torch.zeros(shape, dtype=pool.dtype, device=device) for layer in layers}
        self._line_offsets = (torch.arange(heads) * lines).unsqueeze(1)
        self.lookups = 0
        self.hits = 0

    def __contains__(self, layer: int) -> bool:
        return layer in self.layers

    def clear(self) -> None:
        for tags in self._tags.values():
            tags.fill_(-1)

    def forget(self, layer: int, host_slots: torch.Tensor) -> None:
        """Slots [n] written again (worker side): their old rows must not be served from the cache."""
        if layer not in self.layers:
            return
        tags = self._tags[layer]
        tags[torch.isin(tags, host_slots)] = -1

    def plan(self, layer: int, host_slots: torch.Tensor) -> tuple[RowPlan, torch.Tensor]:
        """Worker side: for selected slots [kv_heads, k], the plan and the slots to gather ([kv_heads, k]
        index rows of the misses, flattened in the plan's upload order, as (head, slot) pairs [misses, 2])."""
        heads, k = host_slots.shape
        tags = self._tags[layer]
        lines = host_slots % self.lines
        flat_lines = (lines + self._line_offsets).view(-1)
        hit = (tags.gather(1, lines) == host_slots).view(-1)
        miss = ~hit
        misses = int(miss.sum())
        self.lookups += heads * k
        self.hits += heads * k - misses
        from_cache = torch.where(hit, flat_lines, torch.full_like(flat_lines, -1))
        upload_rank = torch.cumsum(miss.to(torch.int64), 0) - 1
        from_upload = torch.where(miss, upload_rank, torch.full_like(upload_rank, -1))
        scratch = heads * self.lines
        store_at = torch.full((heads * k,), scratch, dtype=torch.int64)
        miss_index = miss.nonzero().squeeze(1)
        miss_lines = flat_lines[miss_index]
        # one miss per line keeps it (the last one, as index assignment leaves it); the others go to scratch
        winner = torch.full((scratch + 1,), -1, dtype=torch.int64)
        winner[miss_lines] = miss_index
        kept = winner[miss_lines] == miss_index
        store_at[upload_rank[miss_index[kept]]] = miss_lines[kept]
        flat_tags = tags.view(-1)
        flat_tags[miss_lines[kept]] = host_slots.view(-1)[miss_index[kept]]
        heads_of_miss = miss_index // k
        gather_pairs = torch.stack([heads_of_miss, host_slots.view(-1)[miss_index]], dim=1)
        packed = torch.stack([from_cache, from_upload, store_at])
        return RowPlan(packed, misses), gather_pairs

    def assemble(self, layer: int, plan: torch.Tensor, uploaded_keys: torch.Tensor, uploaded_values: torch.Tensor,
                 shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute side: the selected rows in `shape` from the cache and the uploaded misses ([kv * k, dim],
        the first rows filled), then the misses stored in their lines. Fixed shapes throughout."""
        from_cache, from_upload, store_at = plan[0], plan[1], plan[2]
        hit = (from_cache >= 0).unsqueeze(1)
        out = []
        for cache, uploaded in ((self._keys[layer], uploaded_keys), (self._values[layer], uploaded_values)):
            cached_rows = cache.index_select(0, from_cache.clamp(min=0))
            uploaded_rows = uploaded.index_select(0, from_upload.clamp(min=0))
            out.append(torch.where(hit, cached_rows, uploaded_rows).view(shape))
            cache.index_copy_(0, store_at, uploaded)
        return out[0], out[1]

    def bytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in self._keys.values())
