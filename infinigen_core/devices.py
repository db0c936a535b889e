"""CUDA's rules on the CPU: the pool's host memory and the compute device kept apart, as two devices are.

On a GPU the pool and the staging buffers live in (pinned) host memory and everything the model computes
lives on the device. An op that mixes the two fails there ("expected all tensors to be on the same
device"), and a host read of a device value (`item`, `nonzero`, `tolist`, a copy back to the host) makes
the host wait for the GPU. On the CPU both sides share one memory, so neither shows: the CUDA path could
break on its first run while every CPU test passes.

With `INFINIGEN_SEPARATE_DEVICES=1` an engine asked for the CPU computes on `EMULATED_COMPUTE` (`cpu:0`)
and keeps its pool on `EMULATED_HOST` (`cpu:1`): plain CPU memory both, but distinct devices to every
comparison and factory call, so the code takes its CUDA branches (the streamed fetch over
`transfer.ThreadedCpuOps`, copies where devices differ). Inside `SeparateDevicesMode` every tensor's
storage is tagged by the side it lives on (from the device it was created on, or the tensors it was
computed from) and the mode refuses, with the op's name:

- an op that mixes host-tagged and compute-tagged tensors outside `crossing()` (the transfer layer's
  copies are the only crossing; an explicit `.to(device)` is a copy too and allowed);
- a host read of a compute tensor inside `decode_step()` (the engine's one-token forward): no exemption,
  so a decode step that passes under the mode makes no host wait on a GPU;
- anything but a gather from, or a row write into, a `mapped_view` of host memory (on CUDA: pinned memory
  the GPU reads and writes in place over UVA, zero-copy). The compute side may read such a view with a
  gather (`index_select`, `index`, `embedding`) whose indices are compute tensors, write rows into it with
  `index_copy_` whose indices and rows are compute tensors (the pool's new rows), and take views of it; any
  other write through it, any other op that reads it, and host indices or rows are refused.

Tensors made outside the mode or on the plain CPU carry no tag and mix with either side.

    with SeparateDevicesMode():
        engine = InfiniGenEngine(model, tokenizer, config, skew_set=skew)   # with the variable set
        engine.prefill(ids); engine.decode(token)
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

SEPARATE_DEVICES_ENV = "INFINIGEN_SEPARATE_DEVICES"
EMULATED_COMPUTE = torch.device("cpu", 0)
EMULATED_HOST = torch.device("cpu", 1)
HOST, COMPUTE = "host", "compute"
MAPPED = "mapped"  # host memory the compute side may gather from in place (mapped_view)

_SIDE = "_infinigen_side"  # the attribute a tagged storage carries (a storage's Python object lives as long as it)
_local = threading.local()

aten = torch.ops.aten
# what the compute side may do with a mapped view: gather rows out of it, or take a view of it
_MAPPED_GATHERS = {aten.index_select.default, aten.index_select.out, aten.index.Tensor, aten.embedding.default}
_MAPPED_WRITES = {aten.index_copy_.default}  # rows written into it, by the compute side
# ops that read a tensor's values on the host (on a GPU: wait for it, then copy)
_HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten.equal.default, aten.is_nonzero.default, aten._unique2.default, aten.unique_consecutive.default,
               aten.unique_dim.default}


class SeparateDevicesError(RuntimeError):
    """An op the separated devices refuse (see the module docstring)."""


def separate_devices_requested() -> bool:
    return os.environ.get(SEPARATE_DEVICES_ENV, "") not in ("", "0")


def compute_device_for(device: torch.device | str) -> torch.device:
    """The device an engine asked for `device` computes on: `EMULATED_COMPUTE` for the CPU when requested."""
    device = torch.device(device)
    if device.type == "cpu" and separate_devices_requested():
        return EMULATED_COMPUTE
    return device


def is_emulated(device: torch.device) -> bool:
    return device == EMULATED_COMPUTE


def has_separate_host(device: torch.device) -> bool:
    """Whether host memory is not the compute device's memory (a GPU, or the emulation of one)."""
    return device.type == "cuda" or is_emulated(device)


def host_device_for(device: torch.device) -> torch.device:
    """Where host-side tensors (the pool, staging) live for this compute device."""
    return EMULATED_HOST if is_emulated(device) else torch.device("cpu")


def side_of(tensor: torch.Tensor) -> str | None:
    """HOST, COMPUTE, or None for a tensor no mode tagged."""
    return getattr(tensor.untyped_storage(), _SIDE, None)


def tag(tensor: torch.Tensor, side: str | None) -> None:
    """Tag the storage under `tensor` (and so every view of it) as living on `side`."""
    setattr(tensor.untyped_storage(), _SIDE, side)


def tag_module(module: torch.nn.Module, side: str = COMPUTE) -> None:
    """Tag a model's parameters and buffers (made before any mode saw them) as living on `side`."""
    for tensor in (*module.parameters(), *module.buffers()):
        tag(tensor, side)


def is_host_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is in host memory as a GPU run would have it (CPU tensors on a GPU, HOST-tagged ones
    in the emulation)."""
    if tensor.device.type == "cuda":
        return False
    if not _mode_active():
        return True
    return side_of(tensor) != COMPUTE


def mapped_view(tensor: torch.Tensor) -> torch.Tensor:
    """A second tensor over `tensor`'s memory (a host tensor, contiguous) that the compute side may gather
    from in place: the emulation of a CUDA view of pinned memory (transfer.CudaOps.mapped). It keeps no
    reference to `tensor`: its owner keeps that alive as long as the view."""
    if not tensor.is_contiguous():
        raise ValueError("a mapped view needs contiguous host memory")
    size = tensor.numel() * tensor.element_size()
    raw = (ctypes.c_uint8 * max(size, 1)).from_address(tensor.data_ptr())
    view = torch.frombuffer(raw, dtype=torch.uint8, count=size).view(tensor.dtype).view(tensor.shape)
    tag(view, MAPPED)
    return view


@contextmanager
def _flag(name: str, on: bool = True) -> Iterator[None]:
    outer = getattr(_local, name, False)
    setattr(_local, name, outer or on)
    try:
        yield
    finally:
        setattr(_local, name, outer)


def crossing() -> AbstractContextManager[None]:
    """Inside: copies between the host and the compute side (the transfer layer's only)."""
    return _flag("crossing")


def decode_step(on: bool = True) -> AbstractContextManager[None]:
    """Inside: the engine's one-token forward, where a host read of a compute tensor is refused."""
    return _flag("decode", on)


def _side_of_device(device) -> str | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" or device == EMULATED_COMPUTE:
        return COMPUTE
    if device == EMULATED_HOST:
        return HOST
    return None


def _target_device(args, kwargs):
    """The device a factory or a copy puts its result on (`aten.to.device` takes it positionally)."""
    device = kwargs.get("device")
    if device is None:
        device = next((arg for arg in args if isinstance(arg, torch.device)), None)
    return device


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _mode_active() -> bool:
    return active_mode() is not None


def active_mode() -> "_DispatchChecks | None":
    """The separate-devices checks active in this thread, if any (a worker thread enters its own)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _DispatchChecks):
            return mode
    return None


def _refuse_read_in_decode_step(what) -> None:
    raise SeparateDevicesError(
        f"{what} reads a compute tensor on the host inside the decode step: on a GPU the host would wait for "
        "the device here (keep the value on the device, or copy it through the transfer layer)")


def _reading_forbidden() -> bool:
    return getattr(_local, "decode", False) and not getattr(_local, "crossing", False)


class SeparateDevicesMode:
    """Tags and refuses as the module docstring says; per thread (`transfer.Worker` enters one in its own)."""

    def __enter__(self) -> "SeparateDevicesMode":
        self._modes = [_DispatchChecks(), _FunctionChecks()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _FunctionChecks(TorchFunctionMode):
    """The host reads no aten op shows (`tolist`, `numpy` copy the values out directly)."""

    _READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._READS and _reading_forbidden() and side_of(args[0]) == COMPUTE:
            _refuse_read_in_decode_step(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _DispatchChecks(TorchDispatchMode):
    """Tags every op's outputs, refuses mixes and host reads (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        sides = {side for side in map(side_of, inputs) if side is not None}
        if MAPPED in sides:
            _check_mapped_read(func, args, kwargs, inputs)
            out = func(*args, **kwargs)
            self._tag_outputs(out, inputs, {COMPUTE}, None)  # a gather's rows land on the compute side
            return out
        crossing_now = getattr(_local, "crossing", False)
        if len(sides) > 1 and not crossing_now:
            described = ", ".join(f"{side_of(t) or 'untagged'} {tuple(t.shape)}" for t in inputs)
            raise SeparateDevicesError(
                f"{func} mixes host memory (the pool, staging) with compute tensors ({described}): on a GPU they "
                "sit on two devices; move one side first (the transfer layer's copies, or .to(device))")
        target = _side_of_device(_target_device(args, kwargs))
        if COMPUTE in sides and _reading_forbidden() and self._reads_on_host(func, args, target):
            _refuse_read_in_decode_step(func)
        out = func(*args, **kwargs)
        self._tag_outputs(out, inputs, sides, target)
        return out

    @staticmethod
    def _reads_on_host(func, args, target: str | None) -> bool:
        if func in _HOST_READS:
            return True
        if func.overloadpacket in (aten._to_copy, aten.to):
            return target == HOST  # a copy of a compute tensor to host memory
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            indices = args[1] if len(args) > 1 else ()
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)  # mask: nonzero
        return False

    @staticmethod
    def _tag_outputs(out, inputs, sides: set[str], target: str | None) -> None:
        outputs = out if isinstance(out, (list, tuple)) else (out,)
        shared = {id(tensor.untyped_storage()) for tensor in inputs}
        if target is not None:
            side = target  # made on a device, or copied to one
        elif len(sides) == 1:
            side = next(iter(sides))
        else:  # untagged inputs only, or a crossing's mix: the first tagged input decides (a copy's destination)
            side = next((s for s in map(side_of, inputs) if s is not None), None)
        for tensor in outputs:
            if not isinstance(tensor, torch.Tensor):
                continue
            if id(tensor.untyped_storage()) in shared:  # a view or an in-place result: its storage keeps the side it has
                if side_of(tensor) is None and side is not None:
                    tag(tensor, side)
                continue
            tag(tensor, side)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` writes to (its schema's mutable arguments: `self` of an in-place op, `out=`)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[position] if position < len(args) else None)
        written.extend(_tensors((value,), {}))
    return written


def _check_mapped_read(func, args, kwargs, inputs) -> None:
    """An op touching a mapped view: only a gather with compute-side indices, a row write of compute-side rows at
    compute-side indices into it, or a view of it, passes."""
    def describe() -> str:
        return ", ".join(f"{side_of(t) or 'untagged'} {tuple(t.shape)}" for t in inputs)

    written = [t for t in _written(func, args, kwargs) if side_of(t) == MAPPED]
    if written:
        others = [t for t in inputs if all(t is not w for w in written)]
        if func in _MAPPED_WRITES and not any(side_of(t) in (HOST, MAPPED) for t in others):
            return
        raise SeparateDevicesError(f"{func} writes through a mapped view of host memory ({describe()}): the compute "
                                   "side writes only rows of its own at indices of its own into it (index_copy_)")
    if func in _MAPPED_GATHERS:
        if any(side_of(t) == HOST for t in inputs):
            raise SeparateDevicesError(f"{func} gathers from a mapped view with host memory in the op ({describe()}): "
                                       "the indices must be on the compute device")
        return
    if all(side_of(t) == MAPPED for t in inputs) and func.is_view:
        return  # a view of the mapped memory is mapped memory
    raise SeparateDevicesError(f"{func} reads a mapped view of host memory ({describe()}): the compute side may only "
                               "gather rows from it (index_select), each read crossing the link")


@contextmanager
def entered(mode: "_DispatchChecks | None") -> Iterator[None]:
    """In a worker thread: enter a mode like `mode` (the creating thread's), or nothing if None."""
    if mode is None:
        yield
        return
    with SeparateDevicesMode():
        yield
