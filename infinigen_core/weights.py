"""Compact weights for decoding on the CPU: one-row calls read int4/int8/bf16 copies, more rows the fp32 weight.

    kinds = use_decode_weights(model, "auto", kernels)   # {"int4": 210, "q8_0": 1}: what each swapped layer runs
    weights_label(model)                                 # "int4 weights (head q8_0)", "q8_0 weights (head q8_0)",
                                                         # "fp32 weights"
    restore_fp32_weights(model)                          # the plain Linear layers back (nothing was dropped)

A decode step reads every weight once for one token: on the CPU it is bound by memory bandwidth, so the
bytes per weight set its speed (SmolLM2-135M at 2 threads, docs/BENCHMARKS.md: fp32 ~62 ms per token, int4
~20 ms). All kinds are weight-only: the activation row stays floating point, never integers. PyTorch's own
CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are fast with bf16 rows only, so where
they serve the row is rounded to bf16 (8-bit mantissa, fp32's range) and so is their result:
- int4: groups of 32 input channels, each with its own scale and minimum, the layout of GGUF's Q4_1. A
  Q4_0/Q4_1 file's weights, dequantised to fp32 on load, give back their 4-bit codes exactly. With the CPU
  kernels built (the default) the product is their `q4_matvec` (cpu_kernels.py): a float32 row, float32
  scales and minima, a float32 result, so for the default model it is the file's weights times the row to
  float rounding. Without them, ATen's int4 product, with the bf16 row, result, scales and minima. The bf16
  row matters beyond its own error (~0.3% a product): rounding is discontinuous, so two conversations whose
  K/V differ by anything at all (a resume from int8 or float16 rows) re-round their activations apart and
  decode apart by the bf16 step rather than by their difference (issue 31: a resumed conversation's
  perplexity over 128 tokens moved by +-0.3%, as much with float16 rows as with int8 ones; docs/BENCHMARKS.md).
- q8_0: 8-bit codes in groups of 32 inputs, a float32 scale each (GGUF's Q8_0 layout), with a float32 row,
  through the CPU kernels' `q8_matvec` (cpu_kernels.py). A Q8_0, Q5_0 or Q4_0 file's weights give back their
  own codes (exact to the file; the default model's head is Q8_0, most of Gemma 3's layers Q5_0: `q8_codes`);
  other weights are rounded to 8 bits per group of 32, finer than one scale per output channel. What int8
  means wherever the kernels are built: on Gemma 3 270M (Q5_0/Q4_K/Q6_K/Q8_0 layers, none exact in int4) the
  step at one thread went from ~27 to ~21 ms, ATen's int8 product with its bf16 row having read ~6 GB/s against
  the kernel's ~15 (docs/BENCHMARKS.md).
- int8 without the kernels (or inputs not a multiple of 32): one scale per output channel, ATen's product
  with a bf16 row.
- bf16: the weight rounded to bf16 (the output head where it is not Q8_0 or the kernels are not built: its
  input has outlier channels).
"auto", the CPU default, picks int4 per layer where its codes are exact and 8 bits where they are not, so it
never rounds a weight more than int8 does.

A prefill chunk (more than one row) keeps the fp32 weight: the K/V that sessions save stay exactly the fp32
model's, and the model's fingerprint does not depend on this option. The output head, which prefill runs for
one row, stays at the file's Q8_0 codes where it has them (the same logits to float rounding).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_kernels import CpuKernels, pack_q4

WEIGHT_CHOICES = ("auto", "fp32", "int8", "int4")
WEIGHTS_HELP = ("what decode steps read on the CPU: auto (the default: int4 where the file was 4-bit, int8 elsewhere, "
                "in groups of 32 where the CPU kernels are built; the output head at the file's Q8_0 codes where it "
                "has them, else bf16), int4, int8 or fp32; prefill "
                "reads fp32 layers (its one head row the file's Q8_0 codes where the head has them)")
GROUP = 32  # input channels per int4 scale (GGUF's Q4_0/Q4_1 block)
# Below this many weights fp32 is as fast at one row (a [192, 576] K/V projection is in cache either way)
MIN_COMPACT_WEIGHTS = 64 * 1024
EXACT_STEPS = 1e-3  # int4 codes are "exact" when every weight lies within this many steps of its code

log = logging.getLogger(__name__)


class DecodeLinear(nn.Module):
    """A Linear whose one-row calls run on a compact copy of its weight; it keeps the original (possibly tied)
    fp32 parameters for more rows. Subclasses fill `_one_row` (a `row_dtype` row [1, in] -> [1, out])."""

    kind = "fp32"
    row_dtype = torch.bfloat16  # what ATen's int4/int8 products are fast with
    exact = False  # whether its one row gives the fp32 product to float rounding (the file's own codes, a float row)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: ties and fingerprints hold
        # the Linear this layer stands in for, kept unregistered (its Parameters are already ours): putting it
        # back is one assignment, not a new module (prefill does it at every call, see plain_fp32_weights)
        self.__dict__["plain"] = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() != 1:
            return F.linear(x, self.weight, self.bias)
        out = self._one_row(x.reshape(1, self.in_features).to(self.row_dtype)).float()
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _one_row(self, row: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} at one row"


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Asymmetric 4-bit codes per group of 32 inputs: (codes [out, in] int32, scale, low [out, in/32], exact).

    Each group's step is its range / 15 (Q4_0 and Q4_1 groups use all 16 codes); where that leaves weights off
    the grid and every group of the first rows lies on a grid of fewer steps (a Q4_K group's step is its
    sub-block's scale, and it may use only some of its codes), each group takes the longest such span instead.
    `exact`: every weight equals code * scale + low to within EXACT_STEPS of a step (a Q4_0/Q4_1/Q4_K source).
    """
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    low = groups.amin(dim=-1)
    offsets, width = groups - low.unsqueeze(-1), groups.amax(dim=-1) - low

    def on_grid(spans: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor, bool]:
        scale = (width / spans).clamp_min(torch.finfo(torch.float32).tiny)
        steps = offsets / scale.unsqueeze(-1)
        codes = steps.round().clamp(0, 15)
        return codes, scale, bool((steps - codes).abs().max() <= EXACT_STEPS)

    codes, scale, exact = on_grid(15.0)
    if not exact and bool(_longest_spans(offsets[:16], width[:16]).all()):
        spans = _longest_spans(offsets, width)
        if bool(spans.all()):
            codes, scale, exact = on_grid(spans)
    return codes.to(torch.int32).reshape(out_features, in_features), scale, low, exact


def _longest_spans(offsets: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Per group (offsets [..., 32] from its smallest weight, width its range), the most steps, 15 down to 1, of
    a grid from its smallest to its largest weight on which every weight lies; 0 where none is."""
    spans = torch.zeros_like(width)
    for span in range(15, 0, -1):
        open_groups = (spans == 0).nonzero(as_tuple=True)
        if not open_groups[0].numel():
            break
        steps = offsets[open_groups] / (width[open_groups] / span).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        fits = (steps - steps.round()).abs().amax(dim=-1) <= EXACT_STEPS
        spans[open_groups] = torch.where(fits, float(span), 0.0)
    return spans


class Int4DecodeLinear(DecodeLinear):
    """4-bit codes in groups of 32 inputs. With the CPU kernels, their `q4_matvec` with a float32 row (scales and
    minima float32 too); without, ATen's int4 product, which takes the row and gives the result in bf16."""

    kind = "int4"

    def __init__(self, linear: nn.Linear, codes=None, kernels: CpuKernels | None = None) -> None:
        super().__init__(linear)
        codes, scale, low, _ = codes if codes is not None else int4_codes(linear.weight)
        self._float_rows = kernels is not None
        if self._float_rows:
            self.row_dtype = torch.float32
            self.register_buffer("_q4_packed", pack_q4(codes), persistent=False)
            self.register_buffer("_scales", scale.contiguous(), persistent=False)
            self.register_buffer("_lows", low.contiguous(), persistent=False)
            return
        # the kernel computes (code - 8) * scale + zero per group: zero is the group's middle
        scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).contiguous()
        self.register_buffer("_scales_and_zeros", scales_and_zeros.to(torch.bfloat16), persistent=False)
        self.register_buffer("_packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)

    def _one_row(self, row: torch.Tensor) -> torch.Tensor:
        if self._float_rows:
            return CpuKernels.q4_matvec(row, self._q4_packed, self._scales, self._lows)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(row, self._packed, GROUP, self._scales_and_zeros)


class Int8DecodeLinear(DecodeLinear):
    kind = "int8"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (weight / scales.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("_codes", codes, persistent=False)
        self.register_buffer("_scales", scales.to(torch.bfloat16), persistent=False)

    def _one_row(self, row: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(row, self._codes, self._scales)


# Where a GGUF format puts a group's largest magnitude, in steps of its grid: Q8_0 at code +-127; Q5_0 and Q4_0,
# whose codes are q - 16 and q - 8 times one scale per 32 weights, at -16 and -8 (their quantisers choose the scale
# so). Each fits in int8, so such a file's weights give back their own codes; other layers are rounded to 127.
Q8_GRIDS = (127, 16, 8)


def q8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Symmetric 8-bit codes per group of 32 inputs: (codes [out, in] int8, scales [out, in/32] float32, exact).

    Each group's scale is its largest magnitude over the first of Q8_GRIDS on which every weight lies, so a Q8_0,
    Q5_0 or Q4_0 file's weights, dequantised to fp32 on load, give back their codes and scales; where none fits,
    the largest magnitude / 127 (Q8_0's choice). `exact`: every weight equals code * scale to within EXACT_STEPS
    of a step. A grid is tried on the whole weight only where it fits the first rows.
    """
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    largest = groups.abs().amax(dim=-1)

    def on_grid(levels: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor, bool]:
        scales = largest[rows] / levels
        steps = groups[rows] / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        codes = steps.round().clamp(-127, 127)
        return codes, scales, bool((steps - codes).abs().max() <= EXACT_STEPS)

    found = on_grid(Q8_GRIDS[0], slice(None))
    for levels in Q8_GRIDS[1:]:
        if not found[2] and on_grid(levels, slice(0, 16))[2]:
            candidate = on_grid(levels, slice(None))
            found = candidate if candidate[2] else found
    codes, scales, exact = found
    return codes.to(torch.int8).reshape(out_features, in_features), scales.contiguous(), exact


class Q8DecodeLinear(DecodeLinear):
    """8-bit codes in groups of 32 inputs, a float32 scale each, one byte per weight and a float32 row (the CPU
    kernels' q8_matvec): a Q8_0 file's own codes (its output head: exact to the file, where bf16 rounds each
    weight, and half of bf16's bytes), or any body layer's weights rounded to that grid."""

    kind = "q8_0"
    row_dtype = torch.float32

    def __init__(self, linear: nn.Linear, codes=None) -> None:
        super().__init__(linear)
        codes, scales, self.exact = codes if codes is not None else q8_codes(linear.weight)
        self.register_buffer("_codes", codes, persistent=False)
        self.register_buffer("_scales", scales, persistent=False)

    def _one_row(self, row: torch.Tensor) -> torch.Tensor:
        return CpuKernels.q8_matvec(row, self._codes, self._scales)


class Bf16DecodeLinear(DecodeLinear):
    kind = "bf16"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.register_buffer("_weight_bf16", linear.weight.detach().to(torch.bfloat16), persistent=False)

    def _one_row(self, row: torch.Tensor) -> torch.Tensor:
        return F.linear(row, self._weight_bf16)


def compact_unavailable_reason(model: nn.Module) -> str | None:
    """Why compact decode weights cannot serve this model (None: they can)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return f"compact decode weights are for float32 models on the CPU, not {parameter.dtype} on {parameter.device}"
    if not any(type(module) is nn.Linear for module in model.modules()):
        return "the model has no plain Linear layers (already quantised?)"
    for kernel in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm"):
        if not hasattr(torch.ops.aten, kernel):
            return f"this PyTorch ({torch.__version__}) has no aten.{kernel}"
    return None


def _compact_layer(linear: nn.Linear, choice: str, kernels: CpuKernels | None = None) -> DecodeLinear:
    """The compact form `choice` (int8 | int4 | auto) gives one body layer: int4 (through `kernels` where given);
    8 bits in groups of 32 where `kernels` are given, else ATen's int8 with one scale per output channel."""
    if linear.in_features % GROUP:
        return Int8DecodeLinear(linear)
    if choice == "int4":
        return Int4DecodeLinear(linear, kernels=kernels)
    if choice == "auto":
        codes = int4_codes(linear.weight)
        if codes[3]:
            return Int4DecodeLinear(linear, codes, kernels)
    return Q8DecodeLinear(linear) if kernels is not None else Int8DecodeLinear(linear)


def _head_layer(head: nn.Linear, kernels: CpuKernels | None) -> DecodeLinear:
    """The output head: at its own Q8_0 codes where the file had them and the CPU kernels are built, else bf16."""
    if kernels is not None and head.in_features % GROUP == 0:
        codes = q8_codes(head.weight)
        if codes[2]:
            return Q8DecodeLinear(head, codes)
    return Bf16DecodeLinear(head)


def use_decode_weights(model: nn.Module, choice: str, kernels: CpuKernels | None = None) -> dict[str, int]:
    """Swap the model's Linear layers for compact decode layers, in place: `choice` int8 | int4 | auto for the
    body; the output head at its Q8_0 codes when the file's are and `kernels` (the CPU kernels) are given, bf16
    otherwise. Returns how many layers run each kind; {} (the reason logged) where the kernels cannot serve.
    Layers under MIN_COMPACT_WEIGHTS weights stay fp32."""
    if choice == "fp32":
        return {}
    if choice not in WEIGHT_CHOICES:
        raise ValueError(f"unknown decode weights {choice!r}: use {', '.join(WEIGHT_CHOICES)}")
    reason = compact_unavailable_reason(model)
    if reason is not None:
        log.warning("%s decode weights unavailable, keeping fp32: %s", choice, reason)
        return {}
    head = _output_head(model)
    kinds: dict[str, int] = {}
    try:
        with torch.no_grad():
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if type(child) is not nn.Linear or child.weight.numel() < MIN_COMPACT_WEIGHTS:
                        continue
                    layer = _head_layer(child, kernels) if child is head else _compact_layer(child, choice, kernels)
                    setattr(parent, name, layer)
                    kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
    except RuntimeError as error:  # a kernel this build lacks after all: leave the model as it was
        restore_fp32_weights(model)
        log.warning("%s decode weights failed, keeping fp32: %s", choice, error)
        return {}
    return kinds


def compact_layers(model: nn.Module) -> list[tuple[nn.Module, str, DecodeLinear]]:
    """Every compact decode layer of the model, as (parent module, attribute name, layer)."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, DecodeLinear)]


def restore_fp32_weights(model: nn.Module) -> None:
    """Undo `use_decode_weights`: the plain Linear layers back (their fp32 parameters were never dropped)."""
    for parent, name, layer in compact_layers(model):
        setattr(parent, name, layer.plain)


def decode_weight_kinds(model: nn.Module) -> dict[str, int]:
    """How many layers run each compact kind at one row ({} for a plain model)."""
    return dict(Counter(layer.kind for _, _, layer in compact_layers(model)))


def _output_head(model: nn.Module) -> nn.Module | None:
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


@contextmanager
def plain_fp32_weights(model: nn.Module, keep_exact_head: bool = False) -> Iterator[None]:
    """The model with its plain fp32 Linear layers inside the block (a reference to compare against).

    `keep_exact_head` (prefill): an output head at the file's own Q8_0 codes stays, since its one row gives the
    fp32 logits to float rounding from a quarter of the bytes (Gemma 3's 262k-token head: ~6 against ~57 ms at
    two threads), and no K/V depends on it."""
    head = _output_head(model) if keep_exact_head else None
    compact = [(parent, name, layer) for parent, name, layer in compact_layers(model)
               if not (layer is head and layer.exact)]
    for parent, name, layer in compact:
        setattr(parent, name, layer.plain)
    try:
        yield
    finally:
        for parent, name, layer in compact:  # the same compact layers back: nothing is quantised again
            setattr(parent, name, layer)


_SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def weights_label(model: nn.Module) -> str:
    """What decode steps read: 'int4 weights (head q8_0)', 'q8_0 weights (head q8_0)', 'int4/int8 weights (head
    bf16)', 'fp32 weights'."""
    head = _output_head(model)
    body = Counter(m.kind for m in model.modules() if isinstance(m, DecodeLinear) and m is not head)
    if body:
        label = f"{'/'.join(kind for kind, _ in body.most_common())} weights"
        return label + (f" (head {head.kind})" if isinstance(head, DecodeLinear) else "")
    dtype = next(model.parameters()).dtype
    return f"{_SHORT_DTYPE_NAMES.get(dtype, str(dtype).replace('torch.', ''))} weights"
