"""The model flags are declared once (infinigen_core/model_flags.py) and read the same by every command line."""

import pytest

from bench.cli import build_parser as bench_parser
from infinigen_core.cli import build_parser as core_parser
from ui.cli import parse_args as app_args

FLAGS = ["--model", "some/dir", "--device", "cpu", "--weights", "int8", "--no-compile", "--cpu-kernels"]
COMMAND_LINES = {
    "app": lambda extra: app_args(extra),
    "core": lambda extra: core_parser().parse_args(["generate", "--prompt", "hi", *extra]),
    "bench": lambda extra: bench_parser().parse_args(["speed", "--text", "notes.txt", *extra]),
}


@pytest.mark.parametrize("tool", sorted(COMMAND_LINES))
def test_every_cli_reads_the_model_flags_into_the_same_fields(tool):
    args = COMMAND_LINES[tool](FLAGS)
    assert (args.model, args.device, args.weights, args.compile_decode, args.cpu_kernels) == \
        ("some/dir", "cpu", "int8", False, True)
    defaults = COMMAND_LINES[tool]([])
    assert (defaults.model, defaults.weights, defaults.compile_decode, defaults.cpu_kernels) == (None,) * 4
    assert defaults.device == ("cpu" if tool == "bench" else "auto")  # the benchmarks measure the CPU by default


@pytest.mark.parametrize("tool", sorted(COMMAND_LINES))
def test_every_cli_refuses_an_unknown_device_or_weight_kind(tool, capsys):
    for wrong in (["--device", "tpu"], ["--weights", "int3"]):
        with pytest.raises(SystemExit):
            COMMAND_LINES[tool](wrong)
        assert "invalid choice" in capsys.readouterr().err


def test_quantize_is_offered_where_bitsandbytes_weights_can_be_loaded():
    assert app_args(["--quantize", "4bit"]).quantize == "4bit"
    assert core_parser().parse_args(["generate", "--prompt", "hi", "--quantize", "8bit"]).quantize == "8bit"
    assert not hasattr(bench_parser().parse_args(["speed", "--text", "t"]), "quantize")
