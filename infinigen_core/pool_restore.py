"""Rows put into a KV pool without running the model: a saved session's chunks, or another pool's rows.

A mixin of `KVPool` (its one other job besides holding and evicting rows): it writes the pool's own storage,
slot positions and counts, so it lives beside it, but reads as one piece.

    pool.append_rows(layer, keys, values, positions)          # per layer, the same positions in each
    pool.set_total_tokens(total)

A sliding-window layer never reads its rows older than its window again (attention, the C++ lane and the
compiled step read its last `window` slots only). A restore may leave those rows in their chunk (`write_from`):
the chunk's tensors, views of its mapped file, are kept as they are, and the rows are copied in only when
something asks for them (`keys(layer)`, an export, a truncate that brings them back into the window). At 32k
tokens on Gemma 3 (15 of 18 layers sliding over 512 tokens) that is 1.0 of the restore's 1.2 GB never written,
and never resident unless asked for. The chunk's file must stay as it is meanwhile: chunk files are written once
and only ever unlinked (the mapping outlives that), but one cut short in place by another program would fault
the process when the rows are read. Invariants: a layer's deferred rows lie below `size - window`, and are
all of its slots [0, below), each in a piece (rows written before an import are never taken for deferred ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .kv_pool import KVPool


@dataclass(frozen=True)
class ChunkRows:
    """One layer's rows as a chunk holds them: K/V in any dtype, or int8 codes with per-row scales [kv_heads, n]
    (and per-key-channel scales [kv_heads, dim])."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    key_channel_scale: torch.Tensor | None = None

    def part(self, first: int, end: int) -> ChunkRows:
        """Rows [first, end) of these."""
        def rows(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[:, first:end]
        return ChunkRows(self.keys[:, first:end], self.values[:, first:end], rows(self.key_scale),
                         rows(self.value_scale), self.key_channel_scale)


@dataclass
class DeferredRows:
    """A layer's rows in slots [0, `below`) that are still in their chunks: (first slot, rows) per chunk."""

    below: int = 0
    pieces: list[tuple[int, ChunkRows]] = field(default_factory=list)


class RowRestore:
    """Restoring rows (see the module docstring); the attributes are KVPool's."""

    @torch.inference_mode()
    def append_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
                    key_channel_scale: torch.Tensor | None = None, write_from: int = 0) -> None:
        """Restore rows of one layer (e.g. from a saved session) without running the model.

        With `key_scale`/`value_scale` [kv_heads, n], `keys`/`values` are integer codes and each row is
        codes * scale, computed straight into the pool's slots (no full-size temporary); with
        `key_channel_scale` [kv_heads, dim] too, each key channel is then multiplied by its scale. Call it
        for every layer with rows of the same positions, then `set_total_tokens`. Under a limit, the newest
        rows are kept (sinks always). Rows that land in slots below `write_from` (`window_start` of the
        restored size: a sliding layer's rows older than its window) stay in `keys`/`values` until something
        reads them (the module docstring); only where slot and position agree, the pool has no limit and
        `defers_restored_rows`.
        """
        n = positions.numel()
        if n == 0:
            return
        positions = positions.to(self.device)
        if layer == 0:  # layer 0 claims the slots for every layer
            self._append_start = self._size
        start = self._append_start
        rows = ChunkRows(keys, values, key_scale, value_scale, key_channel_scale)
        if self.limit_tokens is not None and start + n > self.limit_tokens:
            self._append_limited(layer, self._widen(rows), self._widen(rows, values=True), positions, start)
            return
        if layer == 0:
            self.ensure_capacity(start + n)
            self._size = start + n
        window = slice(start, start + n)
        self._positions[layer, window] = positions
        self._fetch_counts[layer, window] = 0
        in_place = int(positions[0]) == start and int(positions[-1]) == start + n - 1
        if not in_place:
            self._slots_are_positions = False
        # never under a limit (an evicting pool moves rows), nor after rows written since the deferred ones (a
        # prefill, a chunk inside the window): [0, below) must lie wholly in pieces, or a growth would not copy them
        defers = (self.defers_restored_rows and in_place and self.limit_tokens is None
                  and self.deferred_slots(layer) == start)
        deferred = max(0, min(n, write_from - start)) if defers else 0
        if deferred:
            record = self._deferred.setdefault(layer, DeferredRows())
            record.pieces.append((start, rows))
            record.below = start + deferred
        self._copy_in(layer, start + deferred, rows.part(deferred, n))

    def _copy_in(self, layer: int, first: int, rows: ChunkRows) -> None:
        """Write chunk rows into slots [first, first + n) of `layer`, widening codes into the slots themselves."""
        store, n = self._layers[layer], rows.keys.shape[1]
        if n:
            window = slice(first, first + n)
            self._widen(rows, out=store.keys[:, window])
            self._widen(rows, values=True, out=store.values[:, window])

    # ------------------------------------------------------------------ rows left in their chunks
    def window_start(self, layer: int, size: int | None = None) -> int:
        """The first slot a sliding layer's attention reads while the pool holds `size` slots (default: now):
        its last `window`. 0 for a global layer, and where slots are not positions (attention reads them all,
        masked)."""
        window = (self.sliding_windows or {}).get(layer)
        if window is None or not self._slots_are_positions:
            return 0
        return max(0, (self._size if size is None else size) - window)

    def deferred_slots(self, layer: int) -> int:
        """How many of the layer's first slots still wait in their chunks (0 once written)."""
        record = self._deferred.get(layer)
        return 0 if record is None else record.below

    @torch.inference_mode()
    def write_deferred(self, layer: int | None = None, first: int = 0) -> None:
        """Copy in the deferred rows of `layer` (None: every layer) in slots from `first` on."""
        for each in list(self._deferred) if layer is None else [layer]:
            record = self._deferred.get(each)
            if record is None or record.below <= first:  # nothing deferred from `first` on (a window's read)
                continue
            for piece_start, rows in record.pieces:
                low, high = max(first, piece_start), min(record.below, piece_start + rows.keys.shape[1])
                if low < high:
                    self._copy_in(each, low, rows.part(low - piece_start, high - piece_start))
            self._forget_deferred(each, first)

    def _forget_deferred(self, layer: int, slot: int) -> None:
        """The layer's deferred rows from `slot` on are no longer deferred (written, or cut away)."""
        record = self._deferred[layer]
        record.below = min(record.below, slot)
        record.pieces = [(piece_start, rows) for piece_start, rows in record.pieces if piece_start < record.below]
        if not record.pieces:
            del self._deferred[layer]

    def _deferred_after_truncate(self, kept: int) -> None:
        """After a truncate kept `kept` slots: deferred rows past them are forgotten, and those the window now
        reaches again are written (every layer's deferred rows stay below `size - window`)."""
        for layer in list(self._deferred):
            self._forget_deferred(layer, kept)
            self.write_deferred(layer, self.window_start(layer))

    def _widen(self, rows: ChunkRows, values: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """The keys (or `values`) in the pool's dtype and device, into `out` if given: int8 codes times their
        per-row scales (computed into `out`: no full-size temporary), keys then times their per-channel scales."""
        if values:
            tensor, scale, channel_scale = rows.values, rows.value_scale, None
        else:
            tensor, scale, channel_scale = rows.keys, rows.key_scale, rows.key_channel_scale
        if out is None:
            out = torch.empty(tensor.shape, dtype=self.dtype, device=self.device)
        if scale is None:
            out.copy_(tensor.to(self.device))
        else:
            torch.mul(tensor.to(self.device), scale.to(self.device, self.dtype).unsqueeze(-1), out=out)
        if channel_scale is not None:
            out.mul_(channel_scale.to(self.device, self.dtype).unsqueeze(1))
        return out

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
