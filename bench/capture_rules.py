"""What in a decode step would break a CUDA graph's replay, found on the CPU (docs/CAPTURE.md).

A captured step replays the kernels its capture recorded, with the shapes, scalar arguments and memory
addresses they had then. So between two consecutive steps of one pool capacity, a step that could be captured
runs the same ops, on inputs of the same shapes, with the same scalars, and reads the same memory wherever it
reads a tensor it did not make itself (what it makes comes from the graph's own pool, at fixed addresses).
`StepRecorder` records one step's ops (a dispatch mode, on the thread that runs the step) and `differences`
names every op where two steps part, by kind:

- `ops`: the steps run different ops at this point (a branch on a host value);
- `shape`: an input's shape changed (e.g. a read over the pool's size, which grows by one a token);
- `scalar`: a scalar argument changed (a size, an index or an offset baked into the launch);
- `storage`: the op reads a tensor made outside the step at another place (a new tensor per step where a
  captured step needs a buffer refilled in place, or a view that moved within one), or with other strides or
  another dtype.

A dispatch mode sees the ops of its own thread only: work the step hands to other threads (on CUDA, launched from
the step's thread onto side streams) is recorded with `note`. The recorder keeps every storage it saw alive, so
the allocator cannot hand one step's memory to the next and hide a new tensor at an old address.

    recorder = StepRecorder()
    with recorder:
        engine.decode(token)       # or only the model's forward: see scripts/capture_check.py
    differences(first.ops, second.ops)   # [] for a step that a graph could replay
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class RecordedOp:
    name: str
    shapes: tuple[tuple[int, ...], ...]  # every tensor argument's shape, in order
    scalars: tuple[object, ...]  # every int, float and bool argument, in order
    # per tensor argument: (address of its first element, strides, dtype) if made outside the step, else None
    outside: tuple[tuple[int, tuple[int, ...], torch.dtype] | None, ...]


class StepRecorder(TorchDispatchMode):
    """Records every aten op run on this thread while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[RecordedOp] = []
        self._made: set[int] = set()  # addresses of the memory the step's own ops allocated
        self._kept: list[torch.UntypedStorage] = []  # every storage seen: no address is handed out twice

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [value for value in flat if isinstance(value, torch.Tensor)]
        addresses = [tensor.untyped_storage().data_ptr() for tensor in tensors]
        out = func(*args, **kwargs)
        for result in tree_flatten(out)[0]:
            # new memory: not an input's (a view, an in-place result), whatever the schema says (`to` may copy)
            if isinstance(result, torch.Tensor) and result.untyped_storage().data_ptr() not in addresses:
                self._made.add(result.untyped_storage().data_ptr())
                self._kept.append(result.untyped_storage())
        self._record(str(func), flat)
        return out

    def note(self, name: str, *args) -> None:
        """Record work the step hands to another thread (a side stream's op on CUDA) as an op of the step."""
        self._record(name, list(args))

    def _record(self, name: str, flat: list) -> None:
        tensors = [value for value in flat if isinstance(value, torch.Tensor)]
        self._kept.extend(tensor.untyped_storage() for tensor in tensors)
        scalars = tuple(value for value in flat if isinstance(value, (bool, int, float)))
        self.ops.append(RecordedOp(name, tuple(tuple(t.shape) for t in tensors), scalars, tuple(
            None if t.untyped_storage().data_ptr() in self._made else (t.data_ptr(), tuple(t.stride()), t.dtype)
            for t in tensors)))


@dataclass(frozen=True)
class Difference:
    index: int  # the op's place in the step
    name: str
    kind: str  # "ops", "shape", "scalar" or "storage"


def differences(first: list[RecordedOp], second: list[RecordedOp]) -> list[Difference]:
    """Where two steps part, op by op; after the first `ops` difference the rest is not compared (misaligned)."""
    found = []
    for index, (a, b) in enumerate(zip(first, second)):
        if a.name != b.name or len(a.shapes) != len(b.shapes):
            found.append(Difference(index, f"{a.name} / {b.name}", "ops"))
            return found
        if a.shapes != b.shapes:
            found.append(Difference(index, a.name, "shape"))
        elif a.scalars != b.scalars:
            found.append(Difference(index, a.name, "scalar"))
        elif a.outside != b.outside:  # made outside in one step only, or at another place, strides or dtype
            found.append(Difference(index, a.name, "storage"))
    if len(first) != len(second):
        found.append(Difference(min(len(first), len(second)), "(one step runs more ops)", "ops"))
    return found


def summary(found: list[Difference]) -> dict[str, Counter]:
    """The differences counted per kind and op name."""
    kinds: dict[str, Counter] = {}
    for difference in found:
        kinds.setdefault(difference.kind, Counter())[difference.name] += 1
    return kinds
