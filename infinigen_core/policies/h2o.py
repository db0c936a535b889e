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

    def rebuild(self) -> None:
        pool, heads = self.ctx.pool, self.ctx.adapter.num_kv_heads
        self.scores = [torch.zeros(heads, max(pool.size(l), 1), dtype=torch.float32) for l in range(pool.num_layers)]

    def _scores(self, layer: int, needed: int) -> torch.Tensor:
        scores = self.scores[layer]
        if scores.shape[1] < needed:
            bigger = torch.zeros(scores.shape[0], max(needed, 2 * scores.shape[1]), dtype=scores.dtype)
            bigger[:, : scores.shape[1]] = scores
            self.scores[layer] = scores = bigger
        return scores

    def on_write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        scores = self._scores(layer, int(slots.max()) + 1)
        scores[:, slots.cpu()] = 0.0  # a reused slot starts afresh

    def on_attention(self, layer, slots, probs, new_slots) -> None:
        mass = probs.float().sum(dim=(1, 2)).cpu()  # [kv_heads, rows]
        scores = self._scores(layer, self.ctx.pool.size(layer))
        n_new = new_slots.numel()
        if slots is None:  # dense: rows are the pool's slots in order
            scores[:, : mass.shape[1]] += mass
            return
        scores.scatter_add_(1, slots.cpu(), mass[:, :-n_new])
        scores[:, new_slots.cpu()] += mass[:, -n_new:]

    def select(self, layer: int, past_len: int, first_position: int) -> Selection:
        pool, heads = self.ctx.pool, self.ctx.adapter.num_kv_heads
        positions = pool.positions(layer).cpu()
        k = self.config.budget_tokens_for(past_len)
        recent = k // 2
        is_recent = (positions >= first_position - recent) & (positions < first_position)
        scores = self._scores(layer, positions.numel())[:, : positions.numel()].clone()
        scores = scores.masked_fill(positions >= first_position, float("-inf"))
        scores = scores.masked_fill(is_recent, float("inf"))
        top = scores.topk(k, dim=-1)
        return Selection(top.indices.to(pool.device), scores=top.values)
