"""The flags that choose and load a model, declared once for every command line that loads one (the app,
`python -m infinigen_core`, `python -m bench`), so their names, choices, defaults and help cannot drift apart.

    add_model_flags(parser)                                   # --model --device --weights --compile --cpu-kernels
    add_model_flags(parser, device_default="cpu", quantize=False)
    load_engine(args.model, device=args.device, weights=args.weights, compile_decode=args.compile_decode,
                cpu_kernels=args.cpu_kernels, quantize=args.quantize)

and the engine settings a user may tune, left unset unless given, so a model family's own defaults
(config.FAMILY_DEFAULTS) fill the rest:

    add_setting_flags(parser)                                 # --alpha --budget --min-fetch-tokens ...
    config, chosen = engine_settings(args)
    load_engine(args.model, config=config, user_settings=chosen, ...)
"""

from __future__ import annotations

import argparse

from .compiled import COMPILE_HELP
from .config import TUNABLE_SETTINGS, EngineConfig, parse_budget
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


def add_setting_flags(parser: argparse.ArgumentParser, dense_layers: bool = True) -> None:
    """Add the tunable engine settings (config.TUNABLE_SETTINGS), each None unless given: an unset one takes
    the loaded model family's default, else EngineConfig's."""
    defaults = EngineConfig()
    family = "default: the model family's tuned value, else"
    parser.add_argument("--alpha", type=float, default=None, help=f"({family} {defaults.alpha:g})")
    parser.add_argument("--budget", default=None,
                        help=f"fraction of the context (0.2) or a token count (256) that a sparse layer may fetch "
                             f"({family} {defaults.budget:g})")
    parser.add_argument("--min-fetch-tokens", type=int, default=None,
                        help=f"a fractional budget never fetches fewer tokens than this, 0: no floor ({family} "
                             f"{defaults.min_fetch_tokens})")
    parser.add_argument("--partial-ratio", type=float, default=None, help=f"({family} {defaults.partial_ratio:g})")
    if dense_layers:
        parser.add_argument("--dense-layers", type=int, default=None, help=f"({family} {defaults.dense_layers})")


def engine_settings(args: argparse.Namespace, policy: str = "infinigen") -> tuple[EngineConfig, tuple[str, ...]]:
    """(the EngineConfig of the settings given, the names of those given); ConfigError for a bad value."""
    chosen = tuple(name for name in TUNABLE_SETTINGS if getattr(args, name, None) is not None)
    values = {name: getattr(args, name) for name in chosen}
    if "budget" in values:
        values["budget"], values["budget_is_tokens"] = parse_budget(values["budget"])
    return EngineConfig(policy=policy, **values), chosen
