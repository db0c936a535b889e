"""H2O: heavy hitters (most accumulated attention per KV head) plus a recent window, half the budget each.

Scores accumulate from the attention each layer actually computed: prefill rows see the whole past,
decoding steps only the tokens they kept, so a token that fell out never climbs back (as in H2O).
"""

import torch

from .base import KVPolicy, Selection


class H2OPolicy(KVPolicy):
    name = "h2o"
    needs_attention_weights = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.rebuild()

    def rebuild(self, stored=None) -> None:
        pool = self.ctx.pool
        self.scores: list[torch.Tensor | None] = [None] * pool.num_layers
        # each slot's token position, mirrored on the compute device from the pool's (host) map, so that a
        # selection reads no host memory: kept current by on_write, which knows the new tokens' slots
        self.positions: torch.Tensor | None = None
        self.ensure_capacity(pool.capacity)
        with torch.inference_mode():
            self.positions[:, : pool.size()] = torch.stack(
                [pool.positions(layer) for layer in range(pool.num_layers)]).to(self.ctx.compute_device)

    def ensure_capacity(self, capacity: int) -> None:
        """Scores and positions live on the compute device, one per slot of the pool's capacity."""
        heads, device = self.ctx.adapter.num_kv_heads, self.ctx.compute_device
        for layer, scores in enumerate(self.scores):
            if scores is None or scores.shape[1] < capacity:
                bigger = torch.zeros(heads, capacity, dtype=torch.float32, device=device)
                if scores is not None:
                    bigger[:, : scores.shape[1]] = scores
                self.scores[layer] = bigger
        if self.positions is None or self.positions.shape[1] < capacity:
            bigger = torch.full((len(self.scores), capacity), -1, dtype=torch.int64, device=device)
            if self.positions is not None:
                bigger[:, : self.positions.shape[1]] = self.positions
            self.positions = bigger

    def release_capacity(self, capacity: int) -> None:
        self.scores = [None if scores is None else scores[:, :capacity].clone() for scores in self.scores]
        self.positions = self.positions[:, :capacity].clone()

    def on_write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        self.scores[layer].index_fill_(1, slots, 0.0)  # a reused slot starts afresh
        total = self.ctx.pool.total_tokens  # the step's tokens are reserved: they are the last `n` positions
        new_positions = torch.arange(total - keys.shape[1], total, device=self.ctx.compute_device)
        self.positions[layer].index_copy_(0, slots, new_positions)

    def on_attention(self, layer, slots, probs, new_slots) -> None:
        """probs [kv, group, n, rows]: rows are the pool's slots in order (slots None), or the new tokens
        first and then `slots` (a decode step over selected rows)."""
        mass = probs.float().sum(dim=(1, 2))  # [kv_heads, rows]
        scores = self.scores[layer]
        if slots is None:
            scores[:, : mass.shape[1]] += mass
            return
        n_new = new_slots.numel()
        scores.scatter_add_(1, slots, mass[:, n_new:])
        scores.index_add_(1, new_slots, mass[:, :n_new])

    def select(self, layer: int, past_len: int, first_position: int) -> Selection:
        pool = self.ctx.pool
        positions = self.positions[layer, : pool.size()]
        k = self.config.budget_tokens_for(past_len)
        recent = k // 2
        is_recent = (positions >= first_position - recent) & (positions < first_position)
        scores = self.scores[layer][:, : positions.numel()]
        scores = scores.masked_fill(positions >= first_position, float("-inf"))
        scores = scores.masked_fill(is_recent, float("inf"))
        top = scores.topk(k, dim=-1)
        return Selection(top.indices, scores=top.values)
