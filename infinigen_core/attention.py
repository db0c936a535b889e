"""The attention maths of a step over the KV pool's rows, for any policy and any model family.

    attention = PoolAttention(pool, adapter, policy, device)
    out = attention.prefill(layer, query, new_keys, new_values, scale, query_positions, new_slots)  # n new tokens
    out = attention.decode(layer, query, keys, values, scale, valid, new_slots, selected)  # one, over fetched rows
    out = attention.decode(layer, query, keys, values, scale, valid, new_slots, selected, rows)  # over rows in place

`grouped_attention` is the explicit (eager) form, used where SDPA cannot serve: a policy that reads the
attention weights (H2O), a soft-capping family (Gemma 2), and the recall measurement (`measure_recall`).
Nothing here writes the pool or waits for a fetch: the engine does both, in the step's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .arch import ModelAdapter
from .kv_pool import KVPool
from .policies import KVPolicy, Selection
from .stats import LayerStats


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [heads, n, dim] over keys/values [kv_heads, S, dim]; returns (out [heads, n, dim], probs [kv, group, n, S]).

    `softcap` (Gemma 2) bounds the logits to (-softcap, softcap) through tanh, as the family's attention does.
    """
    kv_heads, n, dim = keys.shape[0], query.shape[1], query.shape[-1]
    # Fold each KV head's query group into rows of one batched product: keys are read in place, never
    # expanded per query head (a broadcast matmul would materialise a copy of them for every head).
    grouped = query.reshape(kv_heads, -1, dim)  # [kv, group*n, dim]
    logits = torch.bmm(grouped, keys.transpose(1, 2)).float().mul_(scale).view(kv_heads, -1, n, keys.shape[1])
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.to(values.dtype).view(kv_heads, -1, keys.shape[1]), values).reshape(query.shape)
    return out, probs



@dataclass(frozen=True)
class PoolAttention:
    """Attention of one engine's layers over its pool under its policy (rebuilt when either changes)."""

    pool: KVPool
    adapter: ModelAdapter
    policy: KVPolicy
    device: torch.device
    kernels: object | None = None  # cpu_kernels.CpuKernels: attend to selected rows where they lie in the pool

    def prefill(self, layer, query, new_keys, new_values, scaling, query_positions, new_slots) -> torch.Tensor:
        """Several new tokens (prefill): causal attention over the pool, masked by positions. A sliding layer
        whose slots are its positions reads only the slots its window can reach (the new tokens are the last
        ones): at long contexts it would otherwise do a global layer's quadratic work, masked away."""
        window = self.adapter.sliding_window(layer)
        first = 0  # the first slot read: before a pool on another device is copied, only what the window reaches
        # (not where the policy reads the attention weights by slot: H2O counts every slot's)
        if window is not None and self.pool.slots_are_positions and not self.policy.needs_attention_weights:
            first = max(0, self.pool.size(layer) - query.shape[-2] - window + 1)  # the first new token's window
        keys, values = self.pool.keys(layer, first), self.pool.values(layer, first)
        positions = self.pool.positions(layer)[first:]
        if keys.device != self.device:  # the new rows are still on their way to the pool: use the device's
            keys, values = keys.to(self.device), values.to(self.device)
            keys.index_copy_(1, new_slots - first, new_keys)
            values.index_copy_(1, new_slots - first, new_values)
        positions = positions.to(self.device).unsqueeze(0)
        mask = positions <= query_positions.unsqueeze(1)  # [n, S]
        if window is not None:  # a sliding layer sees its last `window` positions, itself included
            mask &= positions > query_positions.unsqueeze(1) - window
        softcap = self.adapter.softcap
        if self.policy.needs_attention_weights or softcap is not None:  # SDPA cannot soft-cap
            out, probs = grouped_attention(query[0], keys, values, scaling, mask, softcap)
            if self.policy.needs_attention_weights:
                self.policy.on_attention(layer, None, probs, new_slots)
        else:
            out = F.scaled_dot_product_attention(
                query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
            )[0]
        return out.transpose(0, 1).unsqueeze(0)  # [1, n, heads, dim]

    def decode(self, layer, query, keys, values, scaling, valid, new_slots, selected, rows=None) -> torch.Tensor:
        """One new token over rows [kv_heads, S, dim] (the new token's included): [1, 1, heads, dim].

        Each KV head's query group rides as the query length of one batch entry, so grouped-query
        attention needs no copy of the keys per query head, and at one token no causal mask: `valid`
        (InfiniGen's alpha mask over ranked rows) is the only mask there is. With `rows` [kv_heads, S] the
        keys/values are the whole layer and attention reads those slots of it (fetch.py's rows in place).
        """
        # keys/values: [kv, S, dim] (a pool view) or [kv, 1, S, dim] (a gather, already in SDPA's shape)
        kv_heads, dim = keys.shape[0], keys.shape[-1]
        if rows is not None:
            if self._kernels_attend(query, keys):
                # valid: [1, rows] (every head alike) or [kv_heads, rows] (heads sharing a budget)
                out = self.kernels.attend_rows(query.reshape(kv_heads, -1, dim), keys, values, rows, valid, scaling)
                return out.view(1, 1, -1, dim)
            keys, values = self.pool.gather(layer, rows, shape=(kv_heads, 1, rows.shape[1], dim))
        window = self.adapter.sliding_window(layer)
        if (selected is None and valid is None and keys.dim() == 3 and (window is None or self.pool.slots_are_positions)
                and self._kernels_attend(query, keys)):
            # a dense layer over the pool's own rows: the CPU kernel reads them in place (a sliding layer its window)
            end = keys.shape[1]
            first = 0 if window is None else max(0, end - window)
            out = self.kernels.attend_span(query.reshape(kv_heads, -1, dim), keys, values, first, end, scaling)
            return out.view(1, 1, -1, dim)
        if window is not None and selected is None:  # a sliding layer reads its last `window` positions only
            if self.pool.slots_are_positions:
                keys, values = keys[..., -window:, :], values[..., -window:, :]  # slot i holds position i: a slice
            else:
                positions = self.pool.positions(layer).to(self.device).view(1, -1)
                valid = positions > self.pool.total_tokens - 1 - window
        softcap = self.adapter.softcap
        mask = None if valid is None else valid.view(valid.shape[0], 1, 1, -1)  # per KV head, or all alike
        if self.policy.needs_attention_weights or softcap is not None:  # SDPA cannot soft-cap
            if keys.dim() == 4:
                keys, values = keys[:, 0], values[:, 0]
            out, probs = grouped_attention(query[0], keys, values, scaling, mask, softcap)
            if self.policy.needs_attention_weights:
                self.policy.on_attention(layer, selected, probs, new_slots)
        else:
            if keys.dim() == 3:
                keys, values = keys.unsqueeze(1), values.unsqueeze(1)
            grouped = query.view(kv_heads, 1, -1, dim)  # [kv, 1, group, dim]: a query group per KV head
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
        return out.view(1, 1, -1, dim)

    def _kernels_attend(self, query, keys) -> bool:
        """Whether the CPU kernel can attend here: plain softmax attention over float32 rows."""
        return (self.kernels is not None and not self.policy.needs_attention_weights and self.adapter.softcap is None
                and query.dtype == torch.float32 and keys.dtype == torch.float32
                and self.kernels.fit(self.adapter.group_size, self.adapter.head_dim))

    def measure_recall(self, layer, query, key, scaling, selection: Selection, stats: LayerStats) -> None:
        """How much of the true (dense) attention mass the fetched rows carry; costs a dense pass."""
        past = self.pool.keys(layer).to(self.device)[:, : self.pool.size(layer)]
        is_past = self.pool.positions(layer).to(self.device) < _newest_position(self.pool, layer)
        keys = past[:, is_past]
        slot_of_row = is_past.nonzero().squeeze(1)
        _, probs = grouped_attention(query[0], torch.cat([keys, key[0]], dim=1), torch.cat([keys, key[0]], dim=1), scaling,
                                     softcap=self.adapter.softcap)
        probs = probs[:, :, 0, :]  # [kv, group, rows+1]
        row_index = torch.full((self.pool.size(layer),), -1, dtype=torch.long, device=probs.device)
        row_index[slot_of_row] = torch.arange(slot_of_row.numel(), device=probs.device)
        chosen = rows_read(row_index[selection.slots.to(probs.device)],
                           None if selection.valid is None else selection.valid[:, 1:].to(probs.device),
                           probs.shape[-1])
        chosen[:, -1] = True  # the new token is always attended
        covered = (probs * chosen.unsqueeze(1)).sum(-1)
        stats.attention_recall = float(covered.mean())
        sorted_probs = probs.sort(dim=-1, descending=True).values.cumsum(-1)
        needed = (sorted_probs < 0.9).sum(-1).float() + 1
        stats.tokens_for_90 = int(needed.mean().round())
        # Kept for the prefetch inspector: the dense attention of this step, averaged over heads.
        stats.true_attention = probs[:, :, :-1].mean(dim=(0, 1)).cpu()
        stats.true_attention_positions = self.pool.positions(layer)[slot_of_row.to(self.pool.device)].cpu()


def rows_read(rows: torch.Tensor, read: torch.Tensor | None, count: int) -> torch.Tensor:
    """[kv_heads, count] bool: the rows (indices [kv_heads, width]) a selection's attention read, `read` its mask
    ([1 or kv_heads, width], None: every one). A masked slot may name a row that is read too (past a head's share
    the kernel's slots can repeat): it never unmarks it."""
    kept = torch.ones_like(rows, dtype=torch.int8) if read is None else read.expand_as(rows).to(torch.int8)
    marks = torch.zeros(rows.shape[0], count, dtype=torch.int8, device=rows.device)
    return marks.scatter_reduce_(1, rows, kept, reduce="amax") > 0


def _newest_position(pool: KVPool, layer: int) -> int:
    """Position of the token being decoded (the newest in the pool)."""
    return int(pool.positions(layer).max())
