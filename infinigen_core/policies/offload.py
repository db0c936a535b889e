"""FlexGen-style offloading: every layer copies its whole past KV from the host pool each step."""

from .base import KVPolicy, Selection, eligible_slots


class OffloadPolicy(KVPolicy):
    name = "offload"

    def is_sparse(self, layer: int) -> bool:
        return True  # "sparse" in mechanics only: it fetches every row, through the same copy path

    def select(self, layer: int, past_len: int, first_position: int) -> Selection:
        slots = eligible_slots(self.ctx.pool, layer, first_position)
        return Selection(slots.unsqueeze(0).expand(self.ctx.adapter.num_kv_heads, -1))
