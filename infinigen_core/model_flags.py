"""The flags that choose and load a model, declared once for every command line that loads one (the app,
`python -m infinigen_core`, `python -m bench`), so their names, choices, defaults and help cannot drift apart.

    add_model_flags(parser)                                   # --model --device --weights --compile --cpu-kernels
    add_model_flags(parser, device_default="cpu", quantize=False)
    load_engine(args.model, device=args.device, weights=args.weights, compile_decode=args.compile_decode,
                cpu_kernels=args.cpu_kernels, quantize=args.quantize)
"""

from __future__ import annotations

import argparse

from .compiled import COMPILE_HELP
from .cpu_kernels import CPU_KERNELS_HELP
from .packaged import MODEL_HELP
from .weights import WEIGHT_CHOICES, WEIGHTS_HELP

DEVICE_CHOICES = ("auto", "cpu", "cuda")
QUANTIZE_CHOICES = ("8bit", "4bit")


def add_model_flags(parser: argparse.ArgumentParser, device_default: str = "auto", quantize: bool = True) -> None:
    """Add the model flags to `parser`. `device_default` differs by tool on purpose: the benchmarks measure the
    CPU unless told otherwise. `quantize=False` leaves out --quantize for tools that load no bitsandbytes
    weights."""
    if device_default not in DEVICE_CHOICES:
        raise ValueError(f"device_default must be one of {', '.join(DEVICE_CHOICES)}, not {device_default!r}")
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--device", default=device_default, choices=DEVICE_CHOICES,
                        help=f"where the model runs (default {device_default}; auto: CUDA when there is one)")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default=None, help=WEIGHTS_HELP)
    parser.add_argument("--compile", dest="compile_decode", action=argparse.BooleanOptionalAction, default=None,
                        help=COMPILE_HELP)
    parser.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=None, help=CPU_KERNELS_HELP)
    if quantize:
        parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                            help="load the weights in 8 or 4 bits with bitsandbytes (CUDA only)")
