"""InfiniGen's CPU kernels (kernels/infinigen_cpu.cpp), built once with the C++ compiler inductor also uses.

    kernels, reason = cpu_kernels.build(cache / "kernels", progress)  # (CpuKernels, None) or (None, why not)
    engine = InfiniGenEngine(..., kernels=kernels)                     # None: the eager path

On the CPU a sparse layer's eager path is a chain of small ops (score product, max, alpha count, softmax,
group sum, top-k, sort, two gathers, attention over the copies), each a pass over memory plus dispatch. The
two kernels do the same maths in one pass each: `rehearse_select` from partial query and keys to the selected
slots and the alpha mask, `attend_rows` from the query to the output, reading the selected K/V rows where
they lie in the pool (`attend_span`: the same over a dense layer's slots, where SDPA costs more). Their
results match the eager path's to float rounding (tests/test_cpu_kernels.py);
the time they save is in docs/BENCHMARKS.md. Two more are decode products at a GGUF file's own codes with a
float32 row: `q8_matvec`, the output head at its Q8_0 codes (weights.Q8DecodeLinear), and `q4_matvec`, the
body's layers at their Q4_1 codes (weights.Int4DecodeLinear). The same library holds the decode lane's op
(kernels/decode_lane.cpp, decode_lane.py): a one-token step's attention, layer after layer, with no Python.

Building takes ~20 s the first time and is cached in `directory` (one build per source text and CPU level).
Where it fails (no compiler, no headers) the reason is logged once and the eager path serves.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "infinigen_cpu.cpp"
LANE_SOURCE = SOURCE.with_name("decode_lane.cpp")  # decode_lane.py's op, built into the same library
CPU_KERNELS_HELP = ("build InfiniGen's CPU kernels at load and use them for its selection and sparse attention "
                    "(default: on the CPU; about 20 s the first time, cached after); --no-cpu-kernels runs the eager ops")

# what the compiler may use, by the instruction set ATen itself detected on this CPU
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

# AVX-512's 16-bit multiply-add into int32 in one instruction (`vpdpwssd`, the int8 partial keys' selection), where
# the CPU has it: torch's capability names do not say, the kernel's digest carries the flag
_VNNI_FLAG = "-mavx512vnni"


def _arch_flags(capability: str) -> list[str]:
    flags = list(_ARCH_FLAGS.get(capability, []))
    if capability == "AVX512" and "avx512_vnni" in _cpu_flags():
        flags.append(_VNNI_FLAG)
    return flags


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere: the kernels then build without them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


_built: tuple["CpuKernels | None", str | None] | None = None  # a process registers the ops once
loaded_from: Path | None = None  # the folder of the library loaded (one built elsewhere would register twice)


@dataclass(frozen=True)
class CpuKernels:
    """The loaded ops (float32 tensors on the CPU)."""

    label: str  # e.g. "CPU kernels (AVX512)", for the model summary
    max_group: int = 16  # query heads per KV head the kernels take (kMaxGroup), and head size (kMaxDim)
    max_dim: int = 256

    def fit(self, group: int, dim: int) -> bool:
        """Whether a model with this query group and head size can use the kernels (else: the eager ops)."""
        return group <= self.max_group and dim <= self.max_dim

    @staticmethod
    def rehearse_select(partial_query: torch.Tensor, partial_keys: torch.Tensor, past: int, k: int, alpha: float,
                        width: int | None = None):
        """partial_query [kv, group, r], partial_keys [kv, r, >= past] float32 or float16, or int8 codes with each
        slot's exponent as one more row [kv, r + 1, >= past] (policies/partial_codes.py); slots contiguous ->
        (slots [kv, k] with each head's best `kept` first, their weights [kv, k], valid [1, k + 1] bool over the
        new token then the k slots, alpha_total: query heads x mean tokens within alpha, a 0-dim int64).
        With a `width` > k the heads share kv x k rows (EngineConfig.budget_by_head): slots [kv, width] with the rows
        each head reads first (after them masked slots, which may repeat those), and `valid` [kv, width + 1], one
        mask per head."""
        return torch.ops.infinigen_cpu.rehearse_select(partial_query, partial_keys, past, k, alpha,
                                                       k if width is None else width)

    @staticmethod
    def attend_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                    valid: torch.Tensor | None, scale: float) -> torch.Tensor:
        """One token's attention: query [kv, group, dim] over the rows `rows` [kv, m] of keys/values
        [kv, slots, dim] (each row contiguous), `valid` [m] or [1, m] bool (every head alike), [kv, m] (a mask
        per head) or None -> [kv, group, dim]."""
        return torch.ops.infinigen_cpu.attend_rows(query, keys, values, rows, valid, scale)

    @staticmethod
    def attend_span(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, end: int,
                    scale: float) -> torch.Tensor:
        """One token's attention: query [kv, group, dim] over every slot of [first, end) of keys/values
        [kv, slots, dim] (each row contiguous) -> [kv, group, dim]: a dense layer, attend_rows' arithmetic."""
        return torch.ops.infinigen_cpu.attend_span(query, keys, values, first, end, scale)

    @staticmethod
    def q8_matvec(row: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """row [1, in] (any float dtype) times a weight of int8 codes [out, in] in groups of 32 input channels
        with a float32 scale each [out, in / 32] (GGUF's Q8_0) -> [1, out] float32; traceable (a Meta kernel),
        so a compiled decode step holds it (weights.Q8DecodeLinear, the output head)."""
        return torch.ops.infinigen_cpu.q8_matvec(row, codes, scales)

    @staticmethod
    def q4_matvec(row: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
        """row [1, in] (any float dtype) times a weight of 4-bit codes, two a byte (`pack_q4`: [out, in / 2]
        uint8), each group of 32 input channels code * scale + low with float32 scales and lows [out, in / 32]
        (GGUF's Q4_1) -> [1, out] float32, the row never rounded; traceable like q8_matvec
        (weights.Int4DecodeLinear)."""
        return torch.ops.infinigen_cpu.q4_matvec(row, packed, scales, lows)


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [out, in] (0-15, in a multiple of 32) as q4_matvec reads them: [out, in / 2] uint8, byte j of
    each group of 32 holding code j in its low nibble and code j + 16 in its high one."""
    out_features, in_features = codes.shape
    groups = codes.to(torch.uint8).view(out_features, in_features // 32, 2, 16)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()


def build(directory: Path, progress: Callable[[str], None] | None = None) -> tuple[CpuKernels | None, str | None]:
    """Build (or load from `directory`) and register the kernels: (kernels, None), or (None, why not)."""
    global _built
    if _built is None:
        _built = _build(Path(directory), progress)
    return _built


def _put_ninja_on_path() -> None:
    """torch builds with the `ninja` program: where none is on PATH, use the one of the `ninja` package
    (requirements.txt), whose bin directory is not on PATH when the venv was not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the build then fails with torch's own message, and the eager path serves
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@contextlib.contextmanager
def _only_builder(build_dir: Path) -> Iterator[None]:
    """One process at a time builds or loads in `build_dir`, under an OS lock that dies with its holder. torch's
    own marker (a file named `lock`, which its loader waits on while it exists) outlives a build that was
    killed, and every later start would then wait for ever: holding the OS lock, a marker left is stale."""
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            marker = build_dir / "lock"
            if marker.exists():
                log.warning("removing %s, left by a build that was killed", marker)
                marker.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(directory: Path, progress: Callable[[str], None] | None) -> tuple[CpuKernels | None, str | None]:
    capability = torch.backends.cpu.get_cpu_capability()
    sources = [SOURCE, LANE_SOURCE]
    source = b"".join(path.read_bytes() for path in sources)
    # -fopenmp: at::parallel_for runs on ATen's own OpenMP pool (torch's libgomp, loaded once per process);
    # -fno-trapping-math lets the exponential's floor and selects vectorise (nothing here reads FP traps)
    flags = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math", *_arch_flags(capability)]
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:12]
    name = f"infinigen_cpu_{digest}"
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        build_dir = directory / name
        build_dir.mkdir(parents=True, exist_ok=True)
        if progress is not None and not any(build_dir.glob("*.so")):
            progress("Building InfiniGen's CPU kernels (about 20 s, once)...")
        with _only_builder(build_dir):
            load(name=name, sources=[str(path) for path in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 is_python_module=False, build_directory=str(build_dir), verbose=False)
    except Exception as error:  # a missing compiler, headers or ninja all mean the same here: eager
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
        log.warning("InfiniGen's CPU kernels are unavailable, the eager path serves: %s", reason)
        return None, reason
    global loaded_from
    loaded_from = build_dir
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - started)
    return CpuKernels(label=f"CPU kernels ({capability})"), None
