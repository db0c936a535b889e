"""The decode step compiled: the model's forward at one token through torch.compile (inductor), with the
engine's attention left eager inside it.

    decode = DecodeStep(model)          # eager until compiled
    decode.compile()                    # None, or why decoding stays eager (logged)
    output = decode(**model_inputs)     # the engine's one-token steps; prefill calls the model itself
    decode.label                        # "compiled decode" or "eager decode"
    compile_decode(engine, progress)    # at load: compile an engine's step and warm it up (one decode step)

What one graph holds: the whole forward at one token (embedding, norms, projections, RoPE, MLPs, residuals,
the head), captured with `fullgraph=True`, so a step is either compiled whole or not at all. What it does
not hold: the engine's attention (pool write, fetch, speculation, attention over the pool's rows), Python
that changes with the policy and the pool. It is one opaque custom op per layer, `infinigen::pool_attention`,
which finds the running step through `stepping(step)` (the way vLLM's attention op reads its forward
context). Where the CPU kernels are loaded, the op in the graph is their `infinigen_cpu::attend_layer` instead
(decode_lane.py): in a step the engine opened a decode lane for, the layer runs in C++ with no Python, and in
any other step it hands the layer to `infinigen::pool_attention`. The graph therefore holds no engine, step or
pool: it never recompiles as the conversation and the pool grow, when the policy changes, or when another
engine wraps the same model. Prefill (many tokens)
stays eager, so the graph only ever sees static one-token shapes. On the CPU (the default options) dynamo's
per-call checks of the model's modules are left out (~1.5 ms a step) and layout_watch.py stands in for them:
a model whose layers were swapped (weights.py) is compiled again, and no other model runs this one's graph.

Numbers: with fp32 weights a compiled step's logits are eager's to ~3e-5 (fused kernels sum in another
order). Layers that round their input row to bf16 (int4/int8/bf16 decode weights) turn such an ulp into a
bf16 step now and then, so there the two agree only as closely as any two bf16 roundings do (measured in
docs/BENCHMARKS.md: as far from fp32 as eager is).

On CUDA the op is tagged `cudagraph_unsafe`, so that `compile(mode="reduce-overhead")` lets inductor's graph
partition capture the pieces between attention ops as CUDA graphs (untested: no GPU was at hand; a GPU's
default is eager decoding).

Where torch.compile, inductor or a C++ compiler is missing, or compiling raises, `compile` or the first
step logs the reason once and decoding runs eager. Under the separate-devices checks
(INFINIGEN_SEPARATE_DEVICES, devices.py) nothing is compiled and the step says why: the checks are a
TorchDispatchMode, under which dynamo compiles no frame, and they must see every op. A GPU run has no such
mode; a caller's own dispatch mode for one step (bench's op counter) runs that step eager, so the mode sees
every op, and leaves the compiled step in place.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import devices
from .decode_lane import lane_op_loaded
from .layout_watch import LayoutCompiled

log = logging.getLogger(__name__)

COMPILE_HELP = ("compile the one-token decode step with torch.compile at load (default: on the CPU; about a minute "
                "the first time, seconds from inductor's cache after); --no-compile decodes eagerly")

EAGER_UNDER_CHECKS = ("the separate-devices checks (INFINIGEN_SEPARATE_DEVICES) are a dispatch mode: dynamo "
                      "compiles nothing under it, and they must see every op")

# On the CPU the compiled step's wrapper is C++ (inductor's cpp_wrapper): its ~200 kernel and op calls per
# token then cost no Python each, ~12% of a short chat's step with the default model (docs/BENCHMARKS.md,
# "The output head at its Q8_0 codes"), for a longer first compilation (~3 minutes on 2 cores, cached after)
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True}
COMPILE_OPTIONS = {"fullgraph": True, "dynamic": False}

_running = threading.local()  # .step: the step this thread's forward is running (step.py's Step)


@contextmanager
def stepping(step) -> Iterator[None]:
    """Inside the block, attention ops of this thread run for `step` (what `pool_attention` reads)."""
    outer = getattr(_running, "step", None)
    _running.step = step
    try:
        yield
    finally:
        _running.step = outer


def _attend(layer: int, query, key, value, scaling: float, layer_input, position_embeddings) -> torch.Tensor:
    step = _running.step
    if step.lane is not None:  # the step's lane is open on this thread: the layer runs in C++ (decode_lane.py)
        return torch.ops.infinigen_cpu.attend_layer(query, key, value, None, None, None, layer, scaling)
    return step.work.attend(step, layer, query, key, value, scaling, layer_input, position_embeddings)


# Defined through torch.library.Library, not the custom_op decorator: the decorator's Python wrapper checks
# every call's outputs for aliasing, ~10 us per layer and token that the compiled step does not need.
_LIBRARY = torch.library.Library("infinigen", "DEF")
_LIBRARY.define("pool_attention(Tensor query, Tensor key, Tensor value, Tensor? layer_input, Tensor? cos, "
                "Tensor? sin, int layer, float scaling) -> Tensor", tags=(torch.Tag.cudagraph_unsafe,))


def _pool_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_input: torch.Tensor | None,
                       cos: torch.Tensor | None, sin: torch.Tensor | None, layer: int, scaling: float) -> torch.Tensor:
    # The graph reuses its buffers once the op returns, but the engine keeps the new K/V past it (InfiniGen's
    # partial keys are written at the step's end, a GPU's pool write lands later): it gets copies of its own.
    key, value = key.clone(), value.clone()
    return _attend(layer, query, key, value, scaling, layer_input, None if cos is None else (cos, sin))


def _pool_attention_shape(query, key, value, layer_input, cos, sin, layer, scaling):
    batch, heads, tokens, dim = query.shape
    return query.new_empty(batch, tokens, heads, dim)


_LIBRARY.impl("pool_attention", _pool_attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("infinigen::pool_attention", _pool_attention_shape, lib=_LIBRARY)


def pool_attention(layer: int, query, key, value, scaling: float, layer_input, position_embeddings) -> torch.Tensor:
    """The engine's attention for `layer` in the running step: [1, n, heads, dim].

    Traced, it is the opaque op; run eagerly, a plain call (the op's dispatch would only cost time).
    """
    if torch.compiler.is_compiling():
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        # on the CPU, where this process has the decode lane's op, the graph calls it: C++ from layer to layer in
        # a lane's step, the op below for any other step (the lane's op has no GPU kernel)
        lane = query.device.type == "cpu" and lane_op_loaded()
        op = torch.ops.infinigen_cpu.attend_layer if lane else torch.ops.infinigen.pool_attention
        return op(query, key, value, layer_input, cos, sin, layer, scaling)
    return _attend(layer, query, key, value, scaling, layer_input, position_embeddings)


def compile_unavailable_reason(device: torch.device, backend=None) -> str | None:
    """Why torch.compile cannot serve decoding on `device` (None: it can), found without compiling anything.

    `backend`: a torch.compile backend of the caller's (a test's), which needs no inductor to be probed for.
    """
    if devices.active_mode() is not None:
        return EAGER_UNDER_CHECKS
    if backend is not None:
        return None
    try:
        if not torch._dynamo.is_dynamo_supported():
            return f"torch.compile does not support this Python or platform (PyTorch {torch.__version__})"
        if device.type == "cuda":
            from torch.utils._triton import has_triton

            return None if has_triton() else "inductor needs Triton on CUDA, and it is not installed"
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()  # raises where no working C++ compiler is found
    except Exception as error:  # an import or a probe failing says the same: not here
        return _reason(error)
    return None


def _reason(error: Exception) -> str:
    """One line for the log and the model summary: the compiler's own error where dynamo wrapped it."""
    cause = getattr(error, "inner_exception", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else 'no message'}"


class DecodeStep:
    """The model's forward for one-token steps: compiled once `compile()` succeeded, eager otherwise."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._compiled = None
        self.eager_reason: str | None = "not compiled"  # why decoding is eager (None: it is compiled)

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    @property
    def label(self) -> str:
        return "compiled decode" if self.is_compiled else "eager decode"

    def compile(self, **options) -> str | None:
        """Compile the step (lazily: the first call traces and compiles); returns why not, or None.

        `options` go to torch.compile (mode="reduce-overhead" on CUDA; a test's `backend`).
        """
        device = next(self.model.parameters()).device
        reason = compile_unavailable_reason(device, options.get("backend"))
        if reason is None:
            try:
                if device.type == "cpu" and not options:  # the default: no per-call checks of the model's modules
                    self._compiled = LayoutCompiled.shared(self.model, {**COMPILE_OPTIONS,
                                                                        "options": CPU_INDUCTOR_OPTIONS})
                else:
                    self._compiled = torch.compile(self.model, **COMPILE_OPTIONS, **options)
            except Exception as error:  # torch.compile itself refusing (an unsupported Python, a bad option)
                reason = _reason(error)
        if reason is not None:
            self._fall_back(reason)
        else:
            self.eager_reason = None
        return reason

    def __call__(self, **inputs):
        # under a dispatch mode of the caller's (bench's OpCounter) dynamo compiles nothing: such a step runs eager
        if self._compiled is not None and not is_in_torch_dispatch_mode(include_infra_modes=False):
            try:
                return self._compiled(**inputs)
            except torch._dynamo.exc.TorchDynamoException as error:
                # tracing or compiling failed; with fullgraph nothing of the step has run yet: run it eager
                self._fall_back(_reason(error))
        return self.model(**inputs)

    def _fall_back(self, reason: str) -> None:
        self._compiled = None
        self.eager_reason = reason
        log.warning("decode steps run eager: %s", reason)


def keep_cache_in(directory: Path) -> None:
    """Inductor's cache (compiled graphs and kernels: the next start's compilation takes seconds) goes to
    `directory`, unless $TORCHINDUCTOR_CACHE_DIR names a place of its own. Importing dynamo already set the
    variable to inductor's default (in /tmp, gone at a reboot), so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)


def compile_decode(engine, progress: Callable[[str], None] = print, **options) -> str | None:
    """Compile `engine`'s decode step and run one step on its (empty) conversation, so that the compilation
    happens now and not in the first reply; returns why decoding stays eager, or None."""
    if engine.num_tokens:
        raise ValueError("compile_decode warms up on an empty conversation: call it before the first prefill")
    progress("Compiling the decode step with torch.compile (minutes the first time, seconds from "
             "inductor's cache after)...")
    started = time.perf_counter()
    reason = engine.decode_step.compile(**options)
    if reason is None:
        try:
            engine.decode(0)  # the step compiles on its first call (falling back to eager if that fails)
        except Exception as error:  # the compiled step failed when run: load the model all the same, eager
            engine.decode_step._fall_back(_reason(error))
        finally:
            engine.reset()
        reason = engine.decode_step.eager_reason
    if reason is None:
        progress(f"Decode step compiled in {time.perf_counter() - started:.0f} s")
    else:
        progress(f"Decode steps run eager (torch.compile unavailable): {reason}")
    return reason
