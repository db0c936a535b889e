"""Count the aten operations a piece of code runs, and those among them that wait for the device.

    with OpCounter() as ops:
        engine.decode(token)
    ops.total, ops.syncs          # every aten op (a kernel launch on a GPU), host reads of device values

On a GPU each aten op is a kernel launch and, at batch 1, the launch rate sets the speed; each op in
`SYNCING_OPS` makes the CPU wait until the GPU has caught up. On the CPU nothing waits, but the same ops
run, so counting them here shows what a decode step would cost on a GPU. Host-bound copies that are
invisible to a dispatch mode on the CPU (`.cpu()` of a CPU tensor does nothing) go through
`fetch.HostChannel.to_host`, which keeps its own count.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result the host must read before it can go on: a GPU stall each
SYNCING_OPS = frozenset({
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique", "_unique",
    "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero", "allclose", "repeat_interleave",
    "bincount", "histc", "_assert_async", "index_with_bool_mask",
})
_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class OpCounter(TorchDispatchMode):
    """A dispatch mode that counts aten operations by name while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _INDEXING and _has_bool_index(args):
            name = "index_with_bool_mask"  # a boolean mask's true count decides the shape: a host read
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def syncs(self) -> int:
        return sum(n for name, n in self.counts.items() if name in SYNCING_OPS)

    def sync_counts(self) -> dict[str, int]:
        return {name: n for name, n in self.counts.items() if name in SYNCING_OPS}
