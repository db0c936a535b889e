"""The KV pool's storage over its life: allocated, grown in steps, shrunk with hysteresis, given back.

`KVPool` decides what its rows mean (slots, positions, eviction); this module decides how much memory holds
them and when that changes:

- growth (`capacity_to_hold`): a size asked for before a reply rounds up to a multiple of the growth step,
  never doubled, never past the limit; a step nothing prepared for at least doubles (`capacity_for_step`),
  so a long decode without preparation copies the pool a logarithmic number of times;
- shrinking (`capacity_after_release`): only when the rows in use fill under a quarter of the capacity, and
  then to twice what they need: after a shrink the pool must double before it grows again and fall to a
  quarter before it shrinks again, so edits near a conversation's end never reallocate;
- a new `PoolStorage` is allocated for every change, the rows in use copied over (host layers asked onto huge
  pages first: huge_pages.py); pinned memory that a
  discarded pool held goes back to the system (`release_pinned_memory`), and after a shrink so do the free
  pages of the C heap (`return_freed_heap`).

>>> rule = CapacityRule(growth_tokens=1024, limit_tokens=None)
>>> rule.capacity_to_hold(4097, capacity=256), rule.capacity_after_release(100, capacity=8192)
(5120, 1024)
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from .huge_pages import advise_huge_pages

# a pool shrinks when its capacity exceeds this many times what it holds (see CapacityRule)
SHRINK_WHEN_USED_BELOW = 4


@dataclass(frozen=True)
class CapacityRule:
    """When and to what a pool of `growth_tokens` steps (under an optional `limit_tokens`) is resized."""

    growth_tokens: int
    limit_tokens: int | None

    def _capped(self, tokens: int) -> int:
        return tokens if self.limit_tokens is None else min(tokens, self.limit_tokens)

    def capacity_to_hold(self, tokens: int, capacity: int) -> int | None:
        """The capacity for `tokens` slots (a multiple of the growth step, never past the limit), or None
        when the current `capacity` already holds them."""
        tokens = self._capped(tokens)
        if tokens <= capacity:
            return None
        return self._capped(-(-tokens // self.growth_tokens) * self.growth_tokens)

    def capacity_for_step(self, tokens: int, capacity: int) -> int | None:
        """Room for `tokens` inside a step nothing prepared for: at least double."""
        if tokens <= capacity:
            return None
        return self.capacity_to_hold(max(tokens, 2 * capacity), capacity)

    def capacity_after_release(self, needed: int, capacity: int) -> int | None:
        """The smaller capacity for `needed` slots (twice them, in growth steps, never below one step), or
        None when the pool keeps its storage (it is not four times larger than it needs)."""
        needed = self._capped(needed)
        if capacity <= SHRINK_WHEN_USED_BELOW * max(needed, self.growth_tokens):
            return None
        return self._capped(max(self.growth_tokens, -(-2 * needed // self.growth_tokens) * self.growth_tokens))


@dataclass
class LayerStore:
    keys: torch.Tensor  # [kv_heads, capacity, head_dim]
    values: torch.Tensor

    def __post_init__(self) -> None:
        # [kv_heads * capacity, head_dim] views, made once: a gather is then one index_select per tensor
        self.flat_keys = self.keys.view(-1, self.keys.shape[-1])
        self.flat_values = self.values.view(-1, self.values.shape[-1])


@dataclass(frozen=True)
class PoolStorage:
    """Every tensor of a pool at one capacity: per layer its K/V, per layer and slot the token position
    (-1: free) and the fetch count, and per KV head the offset of its first row in a layer's flat view."""

    layers: list[LayerStore]
    positions: torch.Tensor  # [layers, capacity] int64
    fetch_counts: torch.Tensor  # [layers, capacity] int64
    head_offsets: torch.Tensor  # [kv_heads, 1]

    @staticmethod
    def allocate(num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device, pin_memory: bool, keep_from: PoolStorage | None = None,
                 keep: int = 0, huge_page_layers: Collection[int] = (),
                 unwritten: Mapping[int, int] | None = None) -> PoolStorage:
        """New storage for `capacity` slots per layer, the first `keep` slots copied from `keep_from` (of a layer in
        `unwritten`, from that slot on: rows a restore left in their chunks are not there to copy); the layers
        `huge_page_layers` asked onto huge pages (KVPool's `huge_page_layers`)."""
        shape = (num_kv_heads, capacity, head_dim)
        layers = []
        for layer in range(num_layers):
            keys = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
            values = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
            # rows read by slot: on huge pages where the system has them (before any write)
            if not pin_memory and layer in huge_page_layers:
                advise_huge_pages(keys)
                advise_huge_pages(values)
            first = (unwritten or {}).get(layer, 0)
            if keep > first:
                keys[:, first:keep].copy_(keep_from.layers[layer].keys[:, first:keep])
                values[:, first:keep].copy_(keep_from.layers[layer].values[:, first:keep])
            layers.append(LayerStore(keys, values))
        positions = torch.full((num_layers, capacity), -1, dtype=torch.int64, device=device)
        counts = torch.zeros(num_layers, capacity, dtype=torch.int64, device=device)
        if keep:
            positions[:, :keep] = keep_from.positions[:, :keep]
            counts[:, :keep] = keep_from.fetch_counts[:, :keep]
        head_offsets = (torch.arange(num_kv_heads, device=device) * capacity).unsqueeze(1)
        return PoolStorage(layers, positions, counts, head_offsets)

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def bytes_allocated(self) -> int:
        total = self.positions.numel() * 8 + self.fetch_counts.numel() * 8
        for store in self.layers:
            total += 2 * store.keys.numel() * store.keys.element_size()
        return total


def release_pinned_memory(pool) -> None:
    """Give a discarded pinned pool's memory back to the system (PyTorch's host allocator keeps it cached)."""
    if pool.pin_memory:
        pool.drop_storage()
        empty_host_cache_if(True)


def empty_host_cache_if(pinned: bool) -> None:
    """Hand cached pinned blocks back to the system: PyTorch's host allocator keeps freed ones otherwise."""
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if pinned and empty_host_cache is not None:
        empty_host_cache()


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def return_freed_heap() -> bool:
    """Hand the free pages of the C heap back to the system; returns whether it could (glibc only).

    Tensors below malloc's mmap threshold (128 KiB, raised up to 32 MiB as larger blocks are freed) live in
    the heap, and glibc returns freed heap memory only from its top: a long import's temporaries and a
    grown pool's smaller storages, all freed, otherwise stay resident until the process exits (measured: a
    30k-token import cut to 107 tokens kept ~250 MiB above idle, ~30 MiB after this). Walks every arena,
    so call it only after a shrink, not per step."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
