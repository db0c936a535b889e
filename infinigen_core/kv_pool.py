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
truncate or reset leaves the pool far below it (with hysteresis, so edits near a conversation's end never
reallocate).

>>> pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
>>> slots = pool.reserve(3)
>>> pool.write(0, slots[0], torch.ones(1, 3, 2), torch.zeros(1, 3, 2))
>>> pool.size(0), pool.total_tokens
(3, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _LayerStore:
    keys: torch.Tensor  # [kv_heads, capacity, head_dim]
    values: torch.Tensor

    def __post_init__(self) -> None:
        # [kv_heads * capacity, head_dim] views, made once: a gather is then one index_select per tensor
        self.flat_keys = self.keys.view(-1, self.keys.shape[-1])
        self.flat_values = self.values.view(-1, self.values.shape[-1])


# release_spare shrinks a pool whose capacity exceeds this many times what it holds (see there)
SHRINK_WHEN_USED_BELOW = 4


class PoolCapacityError(RuntimeError):
    pass


class KVPool:
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
        self.total_tokens = 0  # positions handed out so far: the next token gets this position
        self.evicted_tokens = 0
        self.last_reserved: list[torch.Tensor] = []  # per layer, the slots of the newest reserve() call
        self.last_reserved_contiguous = True  # those slots are [size - n, size) in every layer
        self._size = 0  # slots in use are [0, size) in every layer
        self._slots_are_positions = True  # no eviction or limited restore has reordered the slots
        self._append_start = 0
        self._layers: list[_LayerStore] = []
        self._positions = torch.empty(num_layers, 0, dtype=torch.int64, device=self.device)  # -1: free
        self._fetch_counts = torch.empty(num_layers, 0, dtype=torch.int64, device=self.device)
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
    def capacity(self) -> int:
        return self._positions.shape[1]

    # ------------------------------------------------------------------ storage
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate every layer for `capacity` slots, keeping the rows in use."""
        n = self._size
        shape = (self.num_kv_heads, capacity, self.head_dim)
        stores = []
        for layer in range(self.num_layers):
            keys = torch.empty(shape, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory)
            values = torch.empty(shape, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory)
            if n:
                keys[:, :n].copy_(self._layers[layer].keys[:, :n])
                values[:, :n].copy_(self._layers[layer].values[:, :n])
            stores.append(_LayerStore(keys, values))
        positions = torch.full((self.num_layers, capacity), -1, dtype=torch.int64, device=self.device)
        counts = torch.zeros(self.num_layers, capacity, dtype=torch.int64, device=self.device)
        positions[:, :n] = self._positions[:, :n]
        counts[:, :n] = self._fetch_counts[:, :n]
        self._layers, self._positions, self._fetch_counts = stores, positions, counts
        # per KV head, the offset of its first row in a layer's flat [kv_heads * capacity, dim] view
        self._head_offsets = (torch.arange(self.num_kv_heads, device=self.device) * capacity).unsqueeze(1)

    @torch.inference_mode()
    def ensure_capacity(self, tokens: int) -> None:
        """Make room for `tokens` slots per layer now, rounded up to a multiple of `growth_tokens` (never
        past the limit): a size asked for is what is allocated, give or take a growth step.

        Call it before a reply starts: growing allocates (pinned) memory and copies the pool, which must not
        happen in the middle of a token.
        """
        if self.limit_tokens is not None:
            tokens = min(tokens, self.limit_tokens)
        if tokens <= self.capacity:
            return
        capacity = -(-tokens // self.growth_tokens) * self.growth_tokens
        if self.limit_tokens is not None:
            capacity = min(capacity, self.limit_tokens)
        self._allocate(capacity)

    @torch.inference_mode()
    def release_spare(self, upcoming: int = 0) -> bool:
        """Give memory back when the rows in use (plus `upcoming` tokens about to be added) fill less than a
        quarter of the capacity, shrinking to twice that, rounded up to a growth step (never below one step).

        The factor-4 trigger and the factor-2 target are the hysteresis: after a shrink the pool must double
        before it grows again and fall to a quarter before it shrinks again, so a conversation whose turns
        are regenerated or edited near its end never reallocates (a truncate there keeps most rows). Returns
        whether the storage changed: per-slot state sized by the capacity (the policies') must follow.
        Call it between steps, with no write in flight (the engine flushes its fetch worker first).
        """
        needed = self._size + upcoming
        if self.limit_tokens is not None:
            needed = min(needed, self.limit_tokens)
        if self.capacity <= SHRINK_WHEN_USED_BELOW * max(needed, self.growth_tokens):
            return False
        capacity = max(self.growth_tokens, -(-2 * needed // self.growth_tokens) * self.growth_tokens)
        if self.limit_tokens is not None:
            capacity = min(capacity, self.limit_tokens)
        self._allocate(capacity)
        _empty_host_cache_if(self.pin_memory)
        return True

    def _grow_for(self, tokens: int) -> None:
        """Room for `tokens` inside a step nothing prepared for: at least double, so a long decode without
        `ensure_capacity` copies the pool a logarithmic number of times."""
        if tokens > self.capacity:
            self.ensure_capacity(max(tokens, 2 * self.capacity))

    def grows_for(self, n: int) -> bool:
        """Whether reserving `n` more tokens reallocates the pool (a copy of every layer into new storage)."""
        wanted = self._size + n if self.limit_tokens is None else min(self._size + n, self.limit_tokens)
        return wanted > self.capacity

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
            self._grow_for(self._size + n)
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
            slots = torch.cat([appended, self._choose_victims(layer, n - free, first + n)])
            self._positions[layer, slots] = new_positions
            self._fetch_counts[layer, slots] = 0
            slots_per_layer.append(slots)
        self.evicted_tokens += n - free
        self._slots_are_positions = False
        self.total_tokens += n
        self.last_reserved = slots_per_layer
        self.last_reserved_contiguous = False
        return slots_per_layer

    def _choose_victims(self, layer: int, count: int, total_after: int) -> torch.Tensor:
        positions = self._positions[layer, : self._size]
        counts = self._fetch_counts[layer, : self._size]
        protected = (positions < self.sink_tokens) | (positions >= total_after - self.recent_window) | (positions < 0)
        age = (self.total_tokens - positions).clamp(min=1).to(torch.float64)
        rate = counts.to(torch.float64) / age
        rate = rate.masked_fill(protected, float("inf"))
        # lowest fetch rate first; among equals the oldest position goes first
        order = torch.argsort(positions, stable=True)
        order = order[torch.argsort(rate[order], stable=True)]
        victims = order[:count]
        if torch.isinf(rate[victims]).any():
            raise PoolCapacityError("every slot is protected: raise the pool limit or shrink the protected window")
        return victims

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

    def keys(self, layer: int) -> torch.Tensor:
        return self._layers[layer].keys[:, : self._size]

    def values(self, layer: int) -> torch.Tensor:
        return self._layers[layer].values[:, : self._size]

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
        store = self._layers[layer]
        rows = self.flat_rows(slot_index)
        shape = shape or (*slot_index.shape, self.head_dim)
        if out is None:
            keys = store.flat_keys.index_select(0, rows)
            values = store.flat_values.index_select(0, rows)
        else:
            keys = torch.index_select(store.flat_keys, 0, rows, out=out[0].view(-1, self.head_dim))
            values = torch.index_select(store.flat_values, 0, rows, out=out[1].view(-1, self.head_dim))
        if self.counts_fetches:
            self._fetch_counts[layer].index_add_(0, slot_index.reshape(-1), torch.ones_like(slot_index).view(-1))
        return keys.view(shape), values.view(shape)

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
        if n_tokens == 0:
            self._slots_are_positions = True
        return moved

    @torch.inference_mode()
    def clear(self) -> None:
        self.truncate(0)
        self.evicted_tokens = 0

    @torch.inference_mode()
    def append_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
                    key_channel_scale: torch.Tensor | None = None) -> None:
        """Restore rows of one layer (e.g. from a saved session) without running the model.

        With `key_scale`/`value_scale` [kv_heads, n], `keys`/`values` are integer codes and each row is
        codes * scale, computed straight into the pool's slots (no full-size temporary); with
        `key_channel_scale` [kv_heads, dim] too, each key channel is then multiplied by its scale. Call it
        for every layer with rows of the same positions, then `set_total_tokens`. Under a limit, the newest
        rows are kept (sinks always).
        """
        n = positions.numel()
        if n == 0:
            return
        positions = positions.to(self.device)
        if layer == 0:  # layer 0 claims the slots for every layer
            self._append_start = self._size
        start = self._append_start
        if self.limit_tokens is not None and start + n > self.limit_tokens:
            self._append_limited(layer, self._widen(keys, key_scale, key_channel_scale), self._widen(values, value_scale),
                                 positions, start)
            return
        if layer == 0:
            self.ensure_capacity(start + n)
            self._size = start + n
        store = self._layers[layer]
        window = slice(start, start + n)
        for target, rows, scale in ((store.keys, keys, key_scale), (store.values, values, value_scale)):
            if scale is None:
                target[:, window] = rows.to(self.device, self.dtype)
            else:
                torch.mul(rows.to(self.device), scale.to(self.device, self.dtype).unsqueeze(-1), out=target[:, window])
        if key_channel_scale is not None:
            store.keys[:, window].mul_(key_channel_scale.to(self.device, self.dtype).unsqueeze(1))
        self._positions[layer, window] = positions
        self._fetch_counts[layer, window] = 0
        if int(positions[0]) != start or int(positions[-1]) != start + n - 1:
            self._slots_are_positions = False

    def _widen(self, rows: torch.Tensor, scale: torch.Tensor | None,
               channel_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rows in the pool's dtype and device (int8 codes times their per-row and per-channel scales)."""
        rows = rows.to(self.device, self.dtype)
        if scale is not None:
            rows = rows * scale.to(self.device, self.dtype).unsqueeze(-1)
        if channel_scale is not None:
            rows = rows * channel_scale.to(self.device, self.dtype).unsqueeze(1)
        return rows

    def _append_limited(self, layer, keys, values, positions, start) -> None:
        """append_rows past the limit: keep the sinks and the newest rows of the old and the new together."""
        limit = self.limit_tokens
        self.ensure_capacity(limit)
        store = self._layers[layer]
        keys = torch.cat([store.keys[:, :start], keys], dim=1)
        values = torch.cat([store.values[:, :start], values], dim=1)
        positions = torch.cat([self._positions[layer, :start], positions])
        sinks = (positions < self.sink_tokens).nonzero().squeeze(1)
        rest = (positions >= self.sink_tokens).nonzero().squeeze(1)
        keep = torch.cat([sinks, rest[rest.numel() - (limit - sinks.numel()) :]])
        kept = keep.numel()
        store.keys[:, :kept] = keys[:, keep]
        store.values[:, :kept] = values[:, keep]
        self._positions[layer, :kept] = positions[keep]
        self._fetch_counts[layer, :kept] = 0
        self._size = kept
        self._slots_are_positions = False

    def set_total_tokens(self, total: int) -> None:
        self.total_tokens = total

    @torch.inference_mode()
    def copy_from(self, other: "KVPool") -> None:
        """Take over another pool's rows (a settings change that moves the pool or changes its limit)."""
        self.ensure_capacity(other.size())
        for layer in range(self.num_layers):
            order = torch.argsort(other.positions(layer))
            self.append_rows(layer, other.keys(layer)[:, order], other.values(layer)[:, order], other.positions(layer)[order])
        self.total_tokens = other.total_tokens

    def same_layout(self, **settings) -> bool:
        """Whether a pool built with these settings would be this one (so a settings change can keep it)."""
        return all(getattr(self, name) == value for name, value in settings.items())

    # ------------------------------------------------------------------ accounting
    def bytes_allocated(self) -> int:
        """Bytes of host (or device) memory this pool holds, capacity included."""
        total = self._positions.numel() * 8 + self._fetch_counts.numel() * 8
        for store in self._layers:
            total += 2 * store.keys.numel() * store.keys.element_size()
        return total

    def bytes_used(self) -> int:
        """Bytes of the K/V rows in use."""
        return self._size * self.bytes_per_token()

    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.bytes_per_row()

    def bytes_per_row(self) -> int:
        """A key row and a value row of one KV head in one layer: what fetching one slot moves."""
        return 2 * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()


def release_pinned_memory(pool: KVPool) -> None:
    """Give a discarded pinned pool's memory back to the system (PyTorch's host allocator keeps it cached)."""
    if pool.pin_memory:
        pool._layers = []
        _empty_host_cache_if(True)


def _empty_host_cache_if(pinned: bool) -> None:
    """Hand cached pinned blocks back to the system: PyTorch's host allocator keeps freed ones otherwise."""
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if pinned and empty_host_cache is not None:
        empty_host_cache()
