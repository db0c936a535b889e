"""FlexGen-style offloading: every layer reads its whole KV, copied from the host pool one layer ahead.

The way its best users run it: the pool sits in pinned host memory and, while layer i computes, layer
i+1's keys and values are copied to the GPU contiguously on a side stream; no gather, no fetch counting.
On the CPU the pool already is where attention runs, so nothing is copied and offload costs what `full`
does: there is no transfer to save or to lose.
"""

from .base import KVPolicy


class OffloadPolicy(KVPolicy):
    name = "offload"

    def is_sparse(self, layer: int) -> bool:
        return False  # every row, every step: the engine copies whole layers ahead when the pool is off-device
