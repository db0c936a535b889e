"""A forward step's inputs on the compute device: its token ids, its query positions and each layer's new slots.

    inputs = StepInputs(device)
    input_ids, query_positions, device_slots = inputs.for_step(token_ids, first_position, slots, pool)

Where the compute device is apart from the host (a GPU, or its emulation under INFINIGEN_SEPARATE_DEVICES), a
one-token step whose layers share one slot (no eviction) gets them as views of one buffer, refilled by one copy
at every step: the same storage at every step, which is what a captured step replays (docs/CAPTURE.md, piece
1). Otherwise they are new tensors, copied across where the devices differ.
"""

from __future__ import annotations

import torch

from . import devices
from .kv_pool import KVPool


class StepInputs:
    """The compute device's copies of a step's inputs (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._decode = torch.zeros(3, dtype=torch.long, device=device)  # a one-token step's token, position, slot

    def for_step(self, token_ids: list[int], first: int, slots: list[torch.Tensor], pool: KVPool):
        """Token ids [1, n], query positions [n] and per layer the new tokens' slots, on the compute device."""
        n = len(token_ids)
        if n == 1 and devices.has_separate_host(self.device) and pool.last_reserved_contiguous:
            # contiguous slots: the token's is the pool's last, a host count (the slots may be on the compute device)
            values = torch.tensor([token_ids[0], first, pool.size() - 1])
            if self.device.type == "cuda":  # one copy from pinned memory, in the compute stream's order: the step
                self._decode.copy_(values.pin_memory(), non_blocking=True)  # before it has read the buffer by then
            else:
                self._decode.copy_(self.to_device(values))
            return self._decode[0:1].view(1, 1), self._decode[1:2], [self._decode[2:3]] * len(slots)
        input_ids = self.to_device(torch.tensor([token_ids]))
        return input_ids, torch.arange(first, first + n, device=self.device), self._slots_on_device(slots, pool)

    def _slots_on_device(self, slots: list[torch.Tensor], pool: KVPool) -> list[torch.Tensor]:
        if pool.device == self.device:
            return slots
        if pool.last_reserved_contiguous:  # every layer shares one tensor: one copy
            return [self.to_device(slots[0])] * len(slots)
        return [self.to_device(layer_slots) for layer_slots in slots]

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor to the compute device without waiting (pinned, non-blocking) on a GPU."""
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device) if devices.is_emulated(self.device) else tensor
