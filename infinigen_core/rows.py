"""A pool's rows as plain CPU tensors and back: what a saved session holds, named here once.

    rows = export_rows(pool, token_ids, 0, 512)     # {"token_ids", "k.0", "v.0", "pos.0", "k.1", ...}
    import_rows(pool, token_ids, [rows])            # appended after the tokens already held

A chunk maps `tensor_name(kind, layer)` (`k.3`, `pos.3`) to each layer's rows, sorted by position, and
TOKEN_IDS to the token ids. Keys and values are in any dtype, or int8 codes with KEY_SCALES / VALUE_SCALES
[kv_heads, rows] beside them (row = codes * scale) and perhaps KEY_CHANNEL_SCALES [kv_heads, dim] (each
key channel times its scale); the pool widens codes as it copies them in. A sparse layer may also carry
PARTIAL_KEYS [kv_heads, rows, r]: InfiniGen's partial keys of those rows as the live engine held them, which a
restore takes instead of recomputing them from (rounded) keys (`stored_partial_keys`, the policy's rebuild).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from .kv_pool import KVPool

TOKEN_IDS = "token_ids"
KEYS, VALUES, POSITIONS = "k", "v", "pos"
KEY_SCALES, VALUE_SCALES, KEY_CHANNEL_SCALES = "k_scale", "v_scale", "k_channel_scale"
PARTIAL_KEYS = "pk"
# per layer, the partial keys of a layer's slots [kv_heads, n, r] (CPU), or None where it keeps none
PartialKeyExport = Callable[[int, torch.Tensor], "torch.Tensor | None"]


def tensor_name(kind: str, layer: int) -> str:
    """Where a chunk holds one layer's tensor of one kind: `tensor_name(KEYS, 3) == "k.3"`."""
    return f"{kind}.{layer}"


def layers_in(rows: Mapping[str, torch.Tensor]) -> int:
    """How many layers a chunk holds rows for (every layer has its positions)."""
    return sum(1 for name in rows if name.startswith(POSITIONS + "."))


def export_rows(pool: KVPool, token_ids: list[int], start: int, end: int,
                partial_keys: PartialKeyExport | None = None) -> dict[str, torch.Tensor]:
    """K/V rows of positions [start, end) per layer, plus their token ids, as CPU tensors; with `partial_keys`
    also the partial keys of the same rows, for the layers it returns them for."""
    tensors = {TOKEN_IDS: torch.tensor(token_ids[start:end], dtype=torch.int64)}
    for layer in range(pool.num_layers):
        positions = pool.positions(layer)
        rows = ((positions >= start) & (positions < end)).nonzero().squeeze(1)
        rows = rows[torch.argsort(positions[rows])]
        first = int(rows.min()) if rows.numel() else pool.size()  # rows a restore deferred: only those asked for
        tensors[tensor_name(KEYS, layer)] = pool.keys(layer, first)[:, rows - first].cpu().contiguous()
        tensors[tensor_name(VALUES, layer)] = pool.values(layer, first)[:, rows - first].cpu().contiguous()
        tensors[tensor_name(POSITIONS, layer)] = positions[rows].cpu().contiguous()
        partial = partial_keys(layer, rows) if partial_keys is not None else None
        if partial is not None:
            tensors[tensor_name(PARTIAL_KEYS, layer)] = partial
    return tensors


def held_partial_keys(pool: KVPool, policy) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The policy's partial keys of every slot with their positions, per layer that keeps them, in
    `stored_partial_keys`' shape (a settings change that keeps a layer's digest takes them over rather than
    recomputing them from the pool's possibly int8-rounded keys)."""
    if not pool.size():
        return {}
    slots = torch.arange(pool.size(), device=pool.device)
    held = {}
    for layer in policy.partial_key_digests():
        partial = policy.export_partial_keys(layer, slots)
        if partial is not None:
            held[layer] = (pool.positions(layer).cpu().clone(), partial)
    return held


def stored_partial_keys(chunks: Iterable[Mapping[str, torch.Tensor]],
                        num_layers: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the rows whose partial keys the chunks carry: (positions [n], partial keys [kv_heads, n, r]),
    in the chunks' order. Rows of a chunk without them (an exact chunk, an older one) are not in it."""
    stored = {}
    chunks = list(chunks)
    for layer in range(num_layers):
        name = tensor_name(PARTIAL_KEYS, layer)
        carrying = [chunk for chunk in chunks if name in chunk]
        if len(carrying) == 1:
            stored[layer] = (carrying[0][tensor_name(POSITIONS, layer)], carrying[0][name])
        elif carrying:
            stored[layer] = (torch.cat([chunk[tensor_name(POSITIONS, layer)] for chunk in carrying]),
                             torch.cat([chunk[name] for chunk in carrying], dim=1))
    return stored


def rows_in(chunk: Mapping[str, torch.Tensor]) -> int:
    """How many slots a chunk's rows take in a pool (its longest layer: a pool that evicted exports each
    layer's own rows)."""
    return max((rows.numel() for name, rows in chunk.items() if name.startswith(POSITIONS + ".")), default=0)


def import_rows(pool: KVPool, token_ids: list[int], chunks: Iterable[Mapping[str, torch.Tensor]]) -> int:
    """Append exported chunks (in order) to the pool after `token_ids`, extending it; returns the tokens added.

    The pool is sized once for all the chunks before the first is copied in: grown chunk by chunk, it would
    copy itself into new storage at each growth step, and hold two pools at each copy. A sliding layer's rows
    older than its window at the restored size stay in the chunks until read (pool_restore.py)."""
    chunks = list(chunks)
    restored_size = pool.size() + sum(rows_in(chunk) for chunk in chunks)
    pool.ensure_capacity(restored_size)
    write_from = [pool.window_start(layer, restored_size) for layer in range(pool.num_layers)]
    restored = 0
    for chunk in chunks:
        ids = chunk[TOKEN_IDS].tolist()
        start = len(token_ids)
        for layer in range(pool.num_layers):
            positions = chunk[tensor_name(POSITIONS, layer)]
            if positions.numel() and int(positions.min()) < start:
                raise ValueError("chunk positions overlap the tokens already cached")
            pool.append_rows(layer, chunk[tensor_name(KEYS, layer)], chunk[tensor_name(VALUES, layer)], positions,
                             chunk.get(tensor_name(KEY_SCALES, layer)), chunk.get(tensor_name(VALUE_SCALES, layer)),
                             chunk.get(tensor_name(KEY_CHANNEL_SCALES, layer)), write_from[layer])
        token_ids.extend(ids)
        pool.set_total_tokens(len(token_ids))
        restored += len(ids)
    return restored
