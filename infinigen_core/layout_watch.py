"""A model's compiled forward without dynamo's per-call checks of its modules, and the cheaper check that
stands in for them.

Before each call of a compiled function, dynamo checks its guards: that every module, parameter and
attribute the graph was traced through is still what it was. Over a whole model that is ~10,000 checks,
~1.5 ms of a 15 ms one-token step on the CPU (docs/BENCHMARKS.md). `skip_guard_on_all_nn_modules_unsafe`
leaves those guards out; two things then stand in for them:

- Each model is compiled through a forward function of its own (its own code object: dynamo keeps its
  compiled graphs per code object), so another model, even one of the same class, never runs this one's graph.
- A layout snapshot (the model's modules, parameters and buffers, by identity) is compared again only after
  torch registered some module, parameter or buffer in one of the model's modules (its global registration
  hooks: assigning a layer, as weights.py does, registers one). A changed layout is compiled again, once per
  layout seen.

    forward = LayoutCompiled(model, compile_options)
    output = forward(**inputs)

What the snapshot cannot see (dynamo's guards did): parameters whose data moved to another dtype or device
in place (`model.half()`, `model.to(...)`) keep their identity. The engine never does that to a loaded
model; a call after it is refused, found from one parameter's dtype and device, checked at every call.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable

import torch
from torch.nn.modules import module as torch_module

_registrations = itertools.count(1)  # bumped by each registration in a watched model's modules
_seen_registration = 0
_forward_numbers = itertools.count(1)
_SHARED = "_infinigen_layout_compiled"  # where a model keeps its LayoutCompiled


_watched: weakref.WeakSet = weakref.WeakSet()  # the modules of every watched model's layouts


def _registered(parent: torch.nn.Module, name: str, value) -> None:
    """Torch's hook: something was registered in `parent`. Only a watched model's own modules count (a forward
    that slices a ModuleList registers into a new list at every call); not followed while dynamo traces."""
    global _seen_registration
    if not torch.compiler.is_compiling() and parent in _watched:
        _seen_registration = next(_registrations)
    # returns None: the registered value is kept as it is


torch_module.register_module_module_registration_hook(_registered)
torch_module.register_module_parameter_registration_hook(_registered)
torch_module.register_module_buffer_registration_hook(_registered)


def _layout(model: torch.nn.Module) -> tuple:
    return (*model.modules(), *model.parameters(), *model.buffers())


def _same(first: tuple, second: tuple) -> bool:
    return len(first) == len(second) and all(a is b for a, b in zip(first, second))


def forward_of_its_own(model: torch.nn.Module) -> Callable:
    """`model(**inputs)` as a function whose code object no other function shares."""
    def forward(**inputs):
        return model(**inputs)

    name = f"decode_forward_{next(_forward_numbers)}"
    code = forward.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, forward.__globals__, name, None, forward.__closure__)


class LayoutCompiled:
    """`torch.compile(forward_of_its_own(model), **options)` with nn-module guards filtered out, one compiled
    function per layout the model has had. `shared(model, options)`: the one a model already has, so that
    engines over one model share its compiled graphs as they would dynamo's cache."""

    @classmethod
    def shared(cls, model: torch.nn.Module, options: dict) -> LayoutCompiled:
        kept = model.__dict__.get(_SHARED)
        if kept is None or kept._given != options:
            kept = model.__dict__[_SHARED] = cls(model, options)
        return kept


    def __init__(self, model: torch.nn.Module, options: dict) -> None:
        self.model = model
        self._given = options
        self._options = {**options, "options": {**options.get("options", {}),
                                                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}}
        self._compiled: list[tuple[tuple, Callable]] = []
        self._checked_at = -1
        self._current: Callable | None = None
        self._follow_layout()

    @property
    def layouts(self) -> int:
        """How many layouts were compiled."""
        return len(self._compiled)

    def _follow_layout(self) -> None:
        self._checked_at = _seen_registration
        self._probe = next(self.model.parameters())
        self._probe_kind = (self._probe.dtype, self._probe.device)
        layout = _layout(self.model)
        _watched.update(self.model.modules())
        for seen, compiled in self._compiled:
            if _same(seen, layout):
                self._current = compiled
                return
        self._current = torch.compile(forward_of_its_own(self.model), **self._options)
        self._compiled.append((layout, self._current))

    def __call__(self, **inputs):
        if self._checked_at != _seen_registration:
            self._follow_layout()
        if (self._probe.dtype, self._probe.device) != self._probe_kind:
            raise RuntimeError("the model's parameters moved to another dtype or device after its step was compiled: "
                               "compile it again (DecodeStep.compile)")
        return self._current(**inputs)
