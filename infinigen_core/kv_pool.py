"""Host-memory pool holding every token's keys and values, layer by layer.

Rows are slots, not positions: attention does not care about key order (RoPE is already applied), so an
evicted slot is reused in place and the pool never compacts during decoding. Each layer keeps, per slot,
the token position and how often the slot was fetched; eviction removes the slot with the lowest fetch
*rate* (fetches per token of age), sparing attention sinks and a recent window. A new occupant starts
with a count of zero, so it never inherits the popularity of the token it replaced.

Built for a decode loop that never waits: capacity grows in large steps (`ensure_capacity`, called before
a reply starts, so no allocation of pinned memory happens inside a token), every layer holds the same
number of slots, and without a limit the slots of a new token are known on the host (the next free one),
so reserving them is one write for all layers. Fetches are counted only when a limit makes eviction
read the counts. Capacity also shrinks, between steps only: `release_spare` gives memory back when a
truncate or reset leaves the pool far below it. How much memory holds the rows, and when that changes, is
pool_lifecycle.py's job.

>>> pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
>>> slots = pool.reserve(3)
>>> pool.write(0, slots[0], torch.ones(1, 3, 2), torch.zeros(1, 3, 2))
>>> pool.size(0), pool.total_tokens
(3, 3)
"""

from __future__ import annotations

import torch

from .pool_restore import DeferredRows, RowRestore
from .pool_lifecycle import CapacityRule, PoolStorage, empty_host_cache_if, release_pinned_memory

__all__ = ["KVPool", "PoolCapacityError", "release_pinned_memory"]


class PoolCapacityError(RuntimeError):
    pass


class KVPool(RowRestore):
    """Every token's keys and values for all layers (see the module docstring).

    Mutating methods run in inference mode: the pool's tensors are created during forward passes (inference
    mode), and PyTorch forbids updating such tensors in place from outside it.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        limit_tokens: int | None = None,
        sink_tokens: int = 4,
        recent_window: int = 64,
        initial_capacity: int = 256,
        growth_tokens: int = 1024,
        sliding_windows: dict[int, int] | None = None,
        defers_restored_rows: bool = True,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu"
        self.limit_tokens = limit_tokens
        self.sink_tokens = sink_tokens
        self.recent_window = recent_window
        self.growth_tokens = growth_tokens
        # per sliding-window layer its window (the others are read by slot: on huge pages, huge_pages.py)
        self.sliding_windows = sliding_windows
        # a restore may leave a sliding layer's older rows in their chunk (pool_restore.py; the pool read in place)
        self.defers_restored_rows = defers_restored_rows
        self._deferred: dict[int, DeferredRows] = {}  # per layer, rows a restore left in their chunks
        self.total_tokens = 0  # positions handed out so far: the next token gets this position
        self.evicted_tokens = 0
        self.last_reserved: list[torch.Tensor] = []  # per layer, the slots of the newest reserve() call
        self.last_reserved_contiguous = True  # those slots are [size - n, size) in every layer
        self._size = 0  # slots in use are [0, size) in every layer
        self._slots_are_positions = True  # no eviction or limited restore has reordered the slots
        self._append_start = 0
        self._storage: PoolStorage | None = None
        self._allocate(initial_capacity if limit_tokens is None else min(initial_capacity, limit_tokens))

    @property
    def counts_fetches(self) -> bool:
        """Fetch counts feed eviction only, so an unlimited pool does not keep them."""
        return self.limit_tokens is not None

    @property
    def slots_are_positions(self) -> bool:
        """Slot i holds position i in every layer (no eviction or limited restore has reordered them)."""
        return self._slots_are_positions

    @property
    def _rule(self) -> CapacityRule:
        return CapacityRule(self.growth_tokens, self.limit_tokens)

    @property
    def storage(self) -> PoolStorage:
        """The tensors holding the rows now (a new object whenever the pool reallocates)."""
        assert self._storage is not None, "the pool's storage was dropped"
        return self._storage

    @property
    def huge_page_layers(self) -> tuple[int, ...]:
        """The layers attention reads by slot, asked onto huge pages: all but the sliding-window ones."""
        return tuple(layer for layer in range(self.num_layers) if layer not in (self.sliding_windows or {}))

    @property
    def capacity(self) -> int:
        return self._positions.shape[1]

    # ------------------------------------------------------------------ storage (sizes: pool_lifecycle.py)
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate every layer for `capacity` slots, keeping the rows in use."""
        unwritten = {layer: record.below for layer, record in self._deferred.items()}
        self._storage = PoolStorage.allocate(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype,
                                             self.device, self.pin_memory, self._storage, self._size,
                                             self.huge_page_layers, unwritten)
        storage = self._storage
        self._layers, self._positions, self._fetch_counts = storage.layers, storage.positions, storage.fetch_counts
        self._head_offsets = storage.head_offsets

    def drop_storage(self) -> None:
        """Forget every tensor (a discarded pool whose pinned memory goes back: `release_pinned_memory`)."""
        self._layers = []
        self._storage = None
        self._deferred.clear()

    @torch.inference_mode()
    def ensure_capacity(self, tokens: int) -> None:
        """Make room for `tokens` slots per layer now, rounded up to a growth step (never past the limit).

        Call it before a reply starts: growing allocates (pinned) memory and copies the pool, which must not
        happen in the middle of a token.
        """
        capacity = self._rule.capacity_to_hold(tokens, self.capacity)
        if capacity is not None:
            self._allocate(capacity)

    @torch.inference_mode()
    def release_spare(self, upcoming: int = 0) -> bool:
        """Give memory back when the rows in use (plus `upcoming` tokens about to be added) fill less than a
        quarter of the capacity (CapacityRule). Returns whether the storage changed: per-slot state sized
        by the capacity (the policies') must follow. Call it between steps, with no write in flight."""
        capacity = self._rule.capacity_after_release(self._size + upcoming, self.capacity)
        if capacity is None:
            return False
        self._allocate(capacity)
        empty_host_cache_if(self.pin_memory)
        return True

    def grows_to_hold(self, tokens: int) -> bool:
        """Whether holding `tokens` slots (`ensure_capacity`, or a reserve up to them) reallocates the pool: a copy of
        every layer into new storage."""
        return self._rule.capacity_to_hold(tokens, self.capacity) is not None

    # ------------------------------------------------------------------ writing
    @torch.inference_mode()
    def reserve(self, n: int) -> list[torch.Tensor]:
        """Hand out positions for `n` new tokens and return, per layer, the slots they will occupy.

        With a limit, the victims are chosen now, before any speculation of this step, so a slot that was
        selected for attention is never overwritten by the token being decoded.
        """
        if n < 1:
            raise ValueError("reserve needs n >= 1")
        first = self.total_tokens
        limit = self.limit_tokens
        if limit is None or self._size + n <= limit:
            capacity = self._rule.capacity_for_step(self._size + n, self.capacity)
            if capacity is not None:
                self._allocate(capacity)
            slots = torch.arange(self._size, self._size + n, device=self.device)
            self._positions[:, self._size : self._size + n] = slots + (first - self._size)
            if self.counts_fetches:
                self._fetch_counts[:, self._size : self._size + n] = 0
            self._size += n
            self.total_tokens += n
            self.last_reserved = [slots] * self.num_layers
            self.last_reserved_contiguous = True
            return self.last_reserved
        if n > limit - self.sink_tokens - self.recent_window:
            raise PoolCapacityError(
                f"cannot add {n} tokens at once to a pool limited to {limit} tokens with "
                f"{self.sink_tokens} sink and {self.recent_window} recent tokens protected"
            )
        self.ensure_capacity(limit)
        free = limit - self._size
        appended = torch.arange(self._size, limit, device=self.device)
        self._size = limit
        new_positions = torch.arange(first, first + n, dtype=torch.int64, device=self.device)
        slots_per_layer = []
        for layer in range(self.num_layers):
            victims = choose_victims(self._positions[layer, : self._size], self._fetch_counts[layer, : self._size],
                                     n - free, self.total_tokens, first + n, self.sink_tokens, self.recent_window)
            slots = torch.cat([appended, victims])
            self._positions[layer, slots] = new_positions
            self._fetch_counts[layer, slots] = 0
            slots_per_layer.append(slots)
        self.evicted_tokens += n - free
        self._slots_are_positions = False
        self.total_tokens += n
        self.last_reserved = slots_per_layer
        self.last_reserved_contiguous = False
        return slots_per_layer

    @torch.inference_mode()
    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [kv_heads, n, head_dim] of the reserved slots (same device as the pool)."""
        store = self._layers[layer]
        if keys.dtype != self.dtype or keys.device != self.device:
            keys, values = keys.to(self.device, self.dtype), values.to(self.device, self.dtype)
        store.keys.index_copy_(1, slots, keys)
        store.values.index_copy_(1, slots, values)

    # ------------------------------------------------------------------ reading
    def size(self, layer: int | None = None) -> int:
        """Slots in use; every layer holds the same number."""
        return self._size

    def keys(self, layer: int, first: int = 0) -> torch.Tensor:
        """The keys of slots [first, size), every row written (rows a restore deferred are copied in first)."""
        if self._deferred:  # a restore's rows still in their chunk (pool_restore.py): those asked for are written
            self.write_deferred(layer, first)
        return self._layers[layer].keys[:, first : self._size]

    def values(self, layer: int, first: int = 0) -> torch.Tensor:
        """The values of slots [first, size), as `keys`."""
        if self._deferred:
            self.write_deferred(layer, first)
        return self._layers[layer].values[:, first : self._size]

    def positions(self, layer: int) -> torch.Tensor:
        return self._positions[layer, : self._size]

    def fetch_counts(self, layer: int) -> torch.Tensor:
        return self._fetch_counts[layer, : self._size]

    def flat_rows(self, slot_index: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's flat [kv_heads * capacity, dim] view for slots [kv_heads, k], flattened."""
        return (slot_index + self._head_offsets).view(-1)

    @torch.inference_mode()
    def gather(self, layer: int, slot_index: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
               shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the rows `slot_index` [kv_heads, k] (on the pool's device) out of the pool, into `out` if given,
        as [kv_heads, k, head_dim] (or `shape`, e.g. [kv_heads, 1, k, head_dim] for attention).

        One flat index_select per tensor: much cheaper than 2-D advanced indexing. Counts the fetch when
        eviction needs the counts.
        """
        if self._deferred:
            self.write_deferred(layer)
        store = self._layers[layer]
        rows = self.flat_rows(slot_index)
        shape = shape or (*slot_index.shape, self.head_dim)
        if out is None:
            keys = store.flat_keys.index_select(0, rows)
            values = store.flat_values.index_select(0, rows)
        else:
            keys = torch.index_select(store.flat_keys, 0, rows, out=out[0].view(-1, self.head_dim))
            values = torch.index_select(store.flat_values, 0, rows, out=out[1].view(-1, self.head_dim))
        self.count_fetches(layer, slot_index)
        return keys.view(shape), values.view(shape)

    def count_fetches(self, layer: int, slot_index: torch.Tensor) -> None:
        """Count a fetch of each of these slots (once per KV head), where eviction reads the counts."""
        if self.counts_fetches:
            self._fetch_counts[layer].index_add_(0, slot_index.reshape(-1), torch.ones_like(slot_index).view(-1))

    @torch.inference_mode()
    def gather_pairs(self, layer: int, pairs: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy the rows of (KV head, slot) `pairs` [n, 2] into `out` ([n, head_dim] each); counts nothing
        (the caller counts what was selected, cached or not; a streamed fetcher's: its pool defers no rows)."""
        store = self._layers[layer]
        rows = pairs[:, 0] * self.capacity + pairs[:, 1]
        torch.index_select(store.flat_keys, 0, rows, out=out[0])
        torch.index_select(store.flat_values, 0, rows, out=out[1])

    # ------------------------------------------------------------------ whole-pool operations
    @torch.inference_mode()
    def truncate(self, n_tokens: int) -> bool:
        """Forget every token at position >= n_tokens (an edited or regenerated turn).

        Returns whether kept rows moved to other slots (only after eviction reordered them).
        """
        if n_tokens >= self.total_tokens:
            return False
        moved = not self._slots_are_positions
        if not moved:
            kept = min(n_tokens, self._size)
        else:
            self.write_deferred()  # rows that move are written first
            for layer, store in enumerate(self._layers):
                keep = (self._positions[layer, : self._size] < n_tokens).nonzero().squeeze(1)
                kept = keep.numel()
                store.keys[:, :kept] = store.keys[:, keep]
                store.values[:, :kept] = store.values[:, keep]
                self._positions[layer, :kept] = self._positions[layer, keep]
                self._fetch_counts[layer, :kept] = self._fetch_counts[layer, keep]
        self._positions[:, kept:] = -1
        self._fetch_counts[:, kept:] = 0
        self._size = kept
        self.total_tokens = n_tokens
        if self._deferred:
            self._deferred_after_truncate(kept)
        if n_tokens == 0:
            self._slots_are_positions = True
        return moved

    @torch.inference_mode()
    def clear(self) -> None:
        self.truncate(0)
        self.evicted_tokens = 0

    def same_layout(self, **settings) -> bool:
        """Whether a pool built with these settings would be this one (so a settings change can keep it)."""
        return all(getattr(self, name) == value for name, value in settings.items())

    # ------------------------------------------------------------------ accounting
    def bytes_allocated(self) -> int:
        """Bytes of host (or device) memory this pool holds, capacity included."""
        return self._storage.bytes_allocated() if self._storage is not None else 0

    def bytes_used(self) -> int:
        """Bytes of the K/V rows in use."""
        return self._size * self.bytes_per_token()

    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.bytes_per_row()

    def bytes_per_row(self) -> int:
        """A key row and a value row of one KV head in one layer: what fetching one slot moves."""
        return 2 * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()


def choose_victims(positions: torch.Tensor, counts: torch.Tensor, count: int, total_tokens: int, total_after: int,
                   sink_tokens: int, recent_window: int) -> torch.Tensor:
    """The `count` slots (of a layer's `positions` and fetch `counts`) whose rows an evicting pool gives to new
    tokens: the lowest fetch rate first (fetches per token of age), among equals the oldest position; never a
    sink, one of the `recent_window` newest positions once `total_after` tokens are held, or a free slot."""
    protected = (positions < sink_tokens) | (positions >= total_after - recent_window) | (positions < 0)
    age = (total_tokens - positions).clamp(min=1).to(torch.float64)
    rate = counts.to(torch.float64) / age
    rate = rate.masked_fill(protected, float("inf"))
    order = torch.argsort(positions, stable=True)
    order = order[torch.argsort(rate[order], stable=True)]
    victims = order[:count]
    if torch.isinf(rate[victims]).any():
        raise PoolCapacityError("every slot is protected: raise the pool limit or shrink the protected window")
    return victims
