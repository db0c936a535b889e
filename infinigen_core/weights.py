"""Int8 weights for decoding on the CPU: fbgemm's dynamic int8 matmul for one row, the fp32 weight for more.

    swapped = use_int8_decode_weights(model)   # the number of Linear layers (and the tied head) swapped
    weights_label(model)                       # "int8 weights" or "fp32 weights"

At one token per step a decode step reads every weight once: memory and dispatch bound, so weights in
int8 (per output channel, activations quantised per call) make the Linear layers ~2x and the output head
~8x faster than fp32 on an AVX-512 VNNI CPU (docs/BENCHMARKS.md). A prefill chunk keeps the fp32 weight:
its K/V, which sessions save, stay exactly those of the fp32 model, so the model's fingerprint does not
depend on this option. The output head stays fp32: its input (the final hidden state) has outlier channels,
and one scale per row in int8 flipped SmolLM2-135M's first reply token (docs/BENCHMARKS.md, "Int8 decode
weights: accuracy"); prefill's last row would go through it too. Measured and rejected: `torch._weight_int8pack_mm` and torchao 0.18's CPU int8
configs are several times slower than fp32 at one row here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_CHOICES = ("fp32", "int8")
QUANTIZED_ENGINES = ("x86", "fbgemm")  # the CPU engines with a per-channel dynamic int8 linear
# Below this many weights fp32 is as fast at one row (a [192, 576] K/V projection: 13 us fp32, 20 us int8)
MIN_INT8_WEIGHTS = 256 * 1024

log = logging.getLogger(__name__)


def _has_vnni() -> bool:
    """AVX-512 VNNI (or AVX-VNNI) accumulates u8 x s8 in 32 bits: full 8-bit activations cannot saturate."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# fbgemm's AVX2/AVX-512 path adds u8 x s8 pairs in 16 bits (saturates with 8-bit activations): 7-bit there.
# With VNNI 8 bits are safe and halve the activation rounding (SmolLM2: +1.9% perplexity instead of +3.2%).
REDUCE_RANGE = not _has_vnni()


class Int8DecodeLinear(nn.Module):
    """A Linear whose single-row calls run in int8; it keeps the original (possibly tied) fp32 parameters."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: ties and fingerprints hold
        with torch.no_grad():
            weight = linear.weight.detach().float()
            scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
            with warnings.catch_warnings():  # quantized tensors are deprecated; this kernel has no successor yet
                warnings.simplefilter("ignore")
                codes = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                   torch.qint8)
                bias = None if linear.bias is None else linear.bias.detach().float()
                self._packed = torch.ops.quantized.linear_prepack(codes, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() != 1:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.quantized.linear_dynamic(x.reshape(1, self.in_features), self._packed, REDUCE_RANGE)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 at one row"


def quantized_engines() -> list[str]:
    """The quantized CPU engines this PyTorch build has."""
    return list(torch.backends.quantized.supported_engines)


def int8_unavailable_reason(model: nn.Module) -> str | None:
    """Why int8 decode weights cannot serve this model (None: they can)."""
    engines = quantized_engines()
    if not any(engine in engines for engine in QUANTIZED_ENGINES):
        return f"this PyTorch has no x86/fbgemm quantized engine (it has {', '.join(engines) or 'none'})"
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return f"int8 decode weights are for float32 models on the CPU, not {parameter.dtype} on {parameter.device}"
    if not any(type(module) is nn.Linear for module in model.modules()):
        return "the model has no plain Linear layers (already quantised?)"
    return None


def use_int8_decode_weights(model: nn.Module) -> int:
    """Swap the model's large Linear layers, not the output head, for `Int8DecodeLinear`, in place.

    Returns how many were swapped; 0, with the reason logged, where the int8 kernel cannot serve.
    """
    reason = int8_unavailable_reason(model)
    if reason is not None:
        log.warning("int8 decode weights unavailable, keeping fp32: %s", reason)
        return 0
    previous = torch.backends.quantized.engine
    engine = next(e for e in QUANTIZED_ENGINES if e in quantized_engines())
    torch.backends.quantized.engine = engine
    swapped = 0
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and child is not head and child.weight.numel() >= MIN_INT8_WEIGHTS:
                    setattr(parent, name, Int8DecodeLinear(child))
                    swapped += 1
    except RuntimeError as error:  # a kernel this build lacks after all: leave the model as it was
        torch.backends.quantized.engine = previous
        restore_fp32_weights(model)
        log.warning("int8 decode weights failed, keeping fp32: %s", error)
        return 0
    return swapped


def restore_fp32_weights(model: nn.Module) -> None:
    """Undo `use_int8_decode_weights` (the fp32 parameters were never dropped)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8DecodeLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)


@contextmanager
def plain_fp32_weights(model: nn.Module) -> Iterator[None]:
    """The model with its plain fp32 Linear layers inside the block (a reference to compare against)."""
    swapped = any(isinstance(module, Int8DecodeLinear) for module in model.modules())
    restore_fp32_weights(model)
    try:
        yield
    finally:
        if swapped:
            use_int8_decode_weights(model)


_SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def weights_label(model: nn.Module) -> str:
    """'int8 weights' when decoding runs through int8 layers, else the weights' dtype ('fp32 weights')."""
    if any(isinstance(module, Int8DecodeLinear) for module in model.modules()):
        return "int8 weights"
    dtype = next(model.parameters()).dtype
    return f"{_SHORT_DTYPE_NAMES.get(dtype, str(dtype).replace('torch.', ''))} weights"
