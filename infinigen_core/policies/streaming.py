"""StreamingLLM: attention sinks plus the most recent tokens, at the same budget as the others."""

import torch

from .base import KVPolicy, Selection


class StreamingPolicy(KVPolicy):
    name = "streaming"

    def select(self, layer: int, past_len: int, first_position: int) -> Selection:
        pool = self.ctx.pool
        positions = pool.positions(layer)
        k = self.config.budget_tokens_for(past_len)
        priority = positions.to(torch.float64)
        priority = priority.masked_fill(positions < self.config.sink_tokens, float("inf"))
        priority = priority.masked_fill(positions >= first_position, float("-inf"))
        slots = priority.topk(k).indices
        return Selection(slots.unsqueeze(0).expand(self.ctx.adapter.num_kv_heads, -1))
