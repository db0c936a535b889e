"""Host-memory pool holding every token's keys and values, layer by layer.

Rows are slots, not positions: attention does not care about key order (RoPE is already applied), so an
evicted slot is reused in place and the pool never compacts during decoding. Each layer keeps, per slot,
the token position and how often the slot was fetched; eviction removes the slot with the lowest fetch
*rate* (fetches per token of age), sparing attention sinks and a recent window. A new occupant starts
with a count of zero, so it never inherits the popularity of the token it replaced.

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
    positions: torch.Tensor  # [capacity] int64, -1 for a free slot
    fetch_counts: torch.Tensor  # [capacity] int64
    size: int = 0  # slots in use are [0, size)


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
        self.total_tokens = 0  # positions handed out so far: the next token gets this position
        self.evicted_tokens = 0
        self.last_reserved: list[torch.Tensor] = []  # per layer, the slots of the newest reserve() call
        capacity = initial_capacity if limit_tokens is None else min(initial_capacity, limit_tokens)
        self._layers = [self._new_store(capacity) for _ in range(num_layers)]

    # ------------------------------------------------------------------ storage
    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    def _new_store(self, capacity: int) -> _LayerStore:
        shape = (self.num_kv_heads, capacity, self.head_dim)
        positions = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        counts = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        return _LayerStore(self._empty(*shape, dtype=self.dtype), self._empty(*shape, dtype=self.dtype), positions, counts)

    def _grow(self, store: _LayerStore, needed: int) -> None:
        capacity = store.keys.shape[1]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        if self.limit_tokens is not None:
            new_capacity = min(max(needed, new_capacity), self.limit_tokens)
        bigger = self._new_store(new_capacity)
        n = store.size
        bigger.keys[:, :n].copy_(store.keys[:, :n])
        bigger.values[:, :n].copy_(store.values[:, :n])
        bigger.positions[:n].copy_(store.positions[:n])
        bigger.fetch_counts[:n].copy_(store.fetch_counts[:n])
        store.keys, store.values = bigger.keys, bigger.values
        store.positions, store.fetch_counts = bigger.positions, bigger.fetch_counts

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
        new_positions = torch.arange(first, first + n, dtype=torch.int64, device=self.device)
        slots_per_layer = []
        for store in self._layers:
            slots = self._slots_for(store, n, first + n)
            store.positions[slots] = new_positions
            store.fetch_counts[slots] = 0
            slots_per_layer.append(slots)
        self.total_tokens += n
        self.last_reserved = slots_per_layer
        return slots_per_layer

    def _slots_for(self, store: _LayerStore, n: int, total_after: int) -> torch.Tensor:
        limit = self.limit_tokens
        if limit is None or store.size + n <= limit:
            self._grow(store, store.size + n)
            slots = torch.arange(store.size, store.size + n, device=self.device)
            store.size += n
            return slots
        if n > limit - self.sink_tokens - self.recent_window:
            raise PoolCapacityError(
                f"cannot add {n} tokens at once to a pool limited to {limit} tokens with "
                f"{self.sink_tokens} sink and {self.recent_window} recent tokens protected"
            )
        free = limit - store.size
        appended = torch.arange(store.size, store.size + free, device=self.device)
        self._grow(store, store.size + free)
        store.size += free
        victims = self._choose_victims(store, n - free, total_after)
        return torch.cat([appended, victims])

    def _choose_victims(self, store: _LayerStore, count: int, total_after: int) -> torch.Tensor:
        positions = store.positions[: store.size]
        counts = store.fetch_counts[: store.size]
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
        self.evicted_tokens += count if store is self._layers[0] else 0
        return victims

    @torch.inference_mode()
    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [kv_heads, n, head_dim] of the reserved slots."""
        store = self._layers[layer]
        store.keys[:, slots] = keys.to(device=self.device, dtype=self.dtype)
        store.values[:, slots] = values.to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ reading
    def size(self, layer: int) -> int:
        return self._layers[layer].size

    def keys(self, layer: int) -> torch.Tensor:
        store = self._layers[layer]
        return store.keys[:, : store.size]

    def values(self, layer: int) -> torch.Tensor:
        store = self._layers[layer]
        return store.values[:, : store.size]

    def positions(self, layer: int) -> torch.Tensor:
        store = self._layers[layer]
        return store.positions[: store.size]

    def fetch_counts(self, layer: int) -> torch.Tensor:
        store = self._layers[layer]
        return store.fetch_counts[: store.size]

    @torch.inference_mode()
    def gather(self, layer: int, slot_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the rows `slot_index` [kv_heads, k] out of the pool and count the fetch."""
        store = self._layers[layer]
        index = slot_index.to(self.device)
        capacity = store.keys.shape[1]
        # one flat index_select per tensor is much cheaper than 2-D advanced indexing
        flat = (index + torch.arange(self.num_kv_heads, device=self.device).unsqueeze(1) * capacity).reshape(-1)
        shape = (*index.shape, self.head_dim)
        keys = store.keys.view(-1, self.head_dim).index_select(0, flat).view(shape)
        values = store.values.view(-1, self.head_dim).index_select(0, flat).view(shape)
        store.fetch_counts.index_add_(0, index.reshape(-1), torch.ones(index.numel(), dtype=torch.int64, device=self.device))
        return keys, values

    # ------------------------------------------------------------------ whole-pool operations
    @torch.inference_mode()
    def truncate(self, n_tokens: int) -> None:
        """Forget every token at position >= n_tokens (an edited or regenerated turn)."""
        if n_tokens >= self.total_tokens:
            return
        for store in self._layers:
            keep = (store.positions[: store.size] < n_tokens).nonzero().squeeze(1)
            kept = keep.numel()
            store.keys[:, :kept] = store.keys[:, keep]
            store.values[:, :kept] = store.values[:, keep]
            store.positions[:kept] = store.positions[keep]
            store.fetch_counts[:kept] = store.fetch_counts[keep]
            store.positions[kept:] = -1
            store.size = kept
        self.total_tokens = n_tokens

    @torch.inference_mode()
    def clear(self) -> None:
        self.truncate(0)
        self.evicted_tokens = 0

    @torch.inference_mode()
    def append_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None) -> None:
        """Restore rows of one layer (e.g. from a saved session) without running the model.

        With `key_scale`/`value_scale` [kv_heads, n], `keys`/`values` are integer codes and each row is
        codes * scale, computed straight into the pool's slots (no full-size temporary). Call
        `set_total_tokens` afterwards. Under a limit, the newest rows are kept (sinks always).
        """
        store = self._layers[layer]
        n = positions.numel()
        if n == 0:
            return
        positions = positions.to(self.device)
        if self.limit_tokens is not None and store.size + n > self.limit_tokens:
            def widen(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
                rows = rows.to(self.device, self.dtype)
                return rows if scale is None else rows * scale.to(self.device, self.dtype).unsqueeze(-1)

            keys, values, key_scale, value_scale = widen(keys, key_scale), widen(values, value_scale), None, None
            keys = torch.cat([store.keys[:, : store.size], keys], dim=1)
            values = torch.cat([store.values[:, : store.size], values], dim=1)
            positions = torch.cat([store.positions[: store.size], positions])
            sinks = (positions < self.sink_tokens).nonzero().squeeze(1)
            rest = (positions >= self.sink_tokens).nonzero().squeeze(1)
            keep = torch.cat([sinks, rest[rest.numel() - (self.limit_tokens - sinks.numel()) :]])
            keys, values, positions = keys[:, keep], values[:, keep], positions[keep]
            store.size, n = 0, keep.numel()
        self._grow(store, store.size + n)
        window = slice(store.size, store.size + n)
        for target, rows, scale in ((store.keys, keys, key_scale), (store.values, values, value_scale)):
            if scale is None:
                target[:, window] = rows.to(self.device, self.dtype)
            else:
                torch.mul(rows.to(self.device), scale.to(self.device, self.dtype).unsqueeze(-1), out=target[:, window])
        store.positions[window] = positions
        store.fetch_counts[window] = 0
        store.size += n

    def set_total_tokens(self, total: int) -> None:
        self.total_tokens = total

    @torch.inference_mode()
    def copy_from(self, other: "KVPool") -> None:
        """Take over another pool's rows (a settings change that moves the pool or changes its limit)."""
        for layer in range(self.num_layers):
            order = torch.argsort(other.positions(layer))
            self.append_rows(layer, other.keys(layer)[:, order], other.values(layer)[:, order], other.positions(layer)[order])
        self.total_tokens = other.total_tokens

    # ------------------------------------------------------------------ accounting
    def bytes_allocated(self) -> int:
        """Bytes of host (or device) memory this pool holds, capacity included."""
        total = 0
        for store in self._layers:
            for tensor in (store.keys, store.values, store.positions, store.fetch_counts):
                total += tensor.numel() * tensor.element_size()
        return total

    def bytes_used(self) -> int:
        """Bytes of the K/V rows in use."""
        per_row = 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        return sum(store.size for store in self._layers) * per_row

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()
