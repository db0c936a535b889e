"""InfiniGen: rehearse layer i+1's attention from layer i's input, fetch only the tokens it will need.

Per sparse layer a partial key cache [kv_heads, slots, r] stays on the compute device: the keys through
the layer's skew, keeping its r strongest channels. During decoding, the pre-hook of layer i projects
layer i's attention input with layer i+1's query weights (and RoPE at the current position), skews it,
and scores every past token against the partial keys. Per query head it counts the tokens whose logit is
within alpha of that head's maximum; the mean count, capped by the budget, is k. Each KV head then takes
the top-k slots by the *sum of its query group's rehearsed softmax weights*, so a token that any head of
the group cares about strongly is kept, and fetching stays one uniform [kv_heads, k] gather.
"""

from __future__ import annotations

import math
import time

import torch

from .base import KVPolicy, Selection


class InfiniGenPolicy(KVPolicy):
    name = "infinigen"
    needs_skew = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        if ctx.skew_set is None:
            raise ValueError("the infinigen policy needs a skew set (calibrate the model first)")
        device = ctx.compute_device
        self.projections = [
            ctx.skew_set.partial_projection(layer, self.config.partial_ratio).to(device=device, dtype=torch.float32)
            for layer in range(ctx.adapter.num_layers)
        ]
        self.rebuild()

    # ---------------------------------------------------------------- partial key cache
    # Stored channel-major, [kv_heads, r, capacity]: the score product then reads a plain strided slice
    # [:, :, :size] without copying it, which at 8k tokens saves tens of MB of copies per decode step.
    def rebuild(self) -> None:
        pool = self.ctx.pool
        self.partial_keys_t: list[torch.Tensor | None] = [None] * pool.num_layers
        for layer in range(pool.num_layers):
            if self.is_sparse(layer) and pool.size(layer):
                slots = torch.arange(pool.size(layer), device=pool.device)
                self.on_write(layer, slots, pool.keys(layer))

    def on_write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        if not self.is_sparse(layer):
            return
        device = self.ctx.compute_device
        partial = keys.to(device=device, dtype=torch.float32) @ self.projections[layer]  # [kv_heads, n, r]
        self._partial_cache(layer, int(slots.max()) + 1)[:, :, slots.to(device)] = partial.transpose(1, 2)

    def partial_keys(self, layer: int) -> torch.Tensor:
        """[kv_heads, slots, r]: the layer's skewed partial keys, slot by slot (a view)."""
        return self._partial_cache(layer, self.ctx.pool.size(layer))[:, :, : self.ctx.pool.size(layer)].transpose(1, 2)

    def _partial_cache(self, layer: int, needed: int) -> torch.Tensor:
        """The layer's [kv_heads, r, capacity] cache, grown (by doubling) to hold at least `needed` slots."""
        cache = self.partial_keys_t[layer]
        if cache is None or cache.shape[2] < needed:
            capacity = max(needed, 2 * (cache.shape[2] if cache is not None else 128))
            projection = self.projections[layer]
            bigger = torch.zeros(projection.shape[0], projection.shape[2], capacity, device=projection.device)
            if cache is not None:
                bigger[:, :, : cache.shape[2]] = cache
            self.partial_keys_t[layer] = cache = bigger
        return cache

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.partial_keys_t if t is not None)

    # ---------------------------------------------------------------- speculation
    def speculate(self, layer, hidden_states, position_embeddings, first_position):
        target = layer + 1
        if target >= self.ctx.adapter.num_layers or not self.is_sparse(target) or hidden_states.shape[1] != 1:
            return None
        started = time.perf_counter()
        adapter, pool = self.ctx.adapter, self.ctx.pool
        positions = torch.arange(first_position, first_position + hidden_states.shape[1])
        query = adapter.rehearse_query(self.ctx.attention_modules[target], hidden_states, position_embeddings, positions)
        query = query.float().view(adapter.num_kv_heads, adapter.group_size, adapter.head_dim)
        partial_query = query @ self.projections[target]  # [kv_heads, group, r]
        size = pool.size(target)
        # the slot of the token being decoded is reserved but not written yet (it is masked as future below)
        partial_keys_t = self._partial_cache(target, size)[:, :, :size]
        logits = torch.bmm(partial_query * adapter.logit_scale, partial_keys_t)  # [kv_heads, group, size]
        if adapter.softcap is not None:  # rehearse the family's soft-capping too (Gemma 2)
            logits = torch.tanh(logits / adapter.softcap) * adapter.softcap
        # the only slots at or after first_position are the ones reserved for this step's tokens
        new_slots = pool.last_reserved[target].to(logits.device)
        logits[:, :, new_slots] = float("-inf")
        past_len = size - new_slots.numel()
        selection = self.choose(logits, past_len)
        selection.speculate_ms = (time.perf_counter() - started) * 1e3
        return target, selection

    def choose(self, logits: torch.Tensor, past_len: int) -> Selection:
        """Top-k slots per KV head from rehearsed logits [kv_heads, group, slots] (future slots at -inf)."""
        peak = logits.amax(dim=-1, keepdim=True)
        within_alpha = (logits > peak - self.config.alpha).sum(dim=-1).float()
        alpha_count = float(within_alpha.mean())
        k = min(max(1, math.ceil(alpha_count)), self.config.budget_tokens_for(past_len))
        group_weight = torch.softmax(logits, dim=-1).sum(dim=1)  # [kv_heads, slots]
        top = group_weight.topk(k, dim=-1, sorted=False)  # order is irrelevant; unsorted is much faster
        return Selection(top.indices, scores=top.values, alpha_count=alpha_count)
