"""Rows put into a KV pool without running the model: a saved session's chunks, or another pool's rows.

A mixin of `KVPool` (its one other job besides holding and evicting rows): it writes the pool's own storage,
slot positions and counts, so it lives beside it, but reads as one piece.

    pool.append_rows(layer, keys, values, positions)          # per layer, the same positions in each
    pool.set_total_tokens(total)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .kv_pool import KVPool


class RowRestore:
    """Restoring rows (see the module docstring); the attributes are KVPool's."""

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
