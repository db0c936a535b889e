"""Importing a session file holds a bounded amount of memory and disk whatever the file claims.

A zip bomb (a chunk of zeros that unpacks to hundreds of MB), a zip header that lies about a member's size,
an oversized manifest and too many members are refused quickly, with a sentence saying why, and leave no
session and no file behind. Legitimate exports of both chunk formats still import. All on a tiny
random-weight Llama.
"""

import hashlib
import json
import re
import struct
import threading
import time
import zipfile
import zlib

import psutil
import pytest
import torch

from sessions import ImportValidationError, SessionStore
from sessions import archive as archive_module
from sessions.archive import MAX_MANIFEST_BYTES, _header_bound, max_chunk_bytes
from sessions.snapshots import KEY_SMOOTHING_MIN_ROWS, holds_partial_keys, read_chunk, write_chunk

from conftest import make_tiny_engine, random_tokens

BOMB_BYTES = 256 * 2**20
ZEROS = bytes(2**20)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    """A tiny engine holding enough tokens for a chunk long enough to get key channel scales (int8)."""
    engine = make_tiny_engine(tiny_llama)
    engine.prefill(random_tokens(KEY_SMOOTHING_MIN_ROWS + 48, seed=7))
    return engine


def _session(store, engine, kv_format):
    """A session of two turns whose chunks are [0, 520) and [520, 560)."""
    session_id, signature, split = store.create("Limits"), engine.kv_signature(), KEY_SMOOTHING_MIN_ROWS + 8
    store.add_message(session_id, "user", "hello", 0, split)
    store.add_message(session_id, "assistant", "hi", split, engine.num_tokens)
    for start, end in ((0, split), (split, engine.num_tokens)):
        rows = engine.export_rows(start, end, partial_keys=holds_partial_keys(kv_format))  # as the app writes them
        record = write_chunk(store.data_dir, session_id, rows, signature, start, kv_format, engine.partial_key_digests())
        store.add_chunk(session_id, record, signature, end)
    return session_id


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _import_measured(store, path):
    """Import `path`; returns (error or None, seconds, peak RSS growth in bytes, sampled every millisecond)."""
    process, done = psutil.Process(), threading.Event()
    before = peak = process.memory_info().rss

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started, error = time.perf_counter(), None
    try:
        store.import_file(path)
    except ImportValidationError as caught:
        error = caught
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return error, seconds, max(peak, process.memory_info().rss) - before


def _write_bomb(path, signature, tokens, size=BOMB_BYTES):
    """An archive whose one chunk is `size` zero bytes (deflated: about size / 1000 on disk), with a truthful
    size and SHA-256 in its manifest. Built block by block, so the test holds 1 MB of it at most."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("chunks/000000.safetensors", "w") as member:
            for _ in range(size // len(ZEROS)):
                member.write(ZEROS)
                digest.update(ZEROS)
        manifest = {"format": archive_module.ARCHIVE_FORMAT, "title": "Bomb", "system_prompt": "", "settings": {},
                    "model_fingerprint": signature["model_fingerprint"], "signature": signature,
                    "messages": [{"role": "user", "content": "hi", "token_start": 0, "token_end": tokens}],
                    "chunks": [{"start": 0, "end": tokens, "size": size, "sha256": digest.hexdigest()}]}
        archive.writestr("manifest.json", json.dumps(manifest))
    return path


@pytest.mark.parametrize("tokens, refusal", [
    (560, "more than the .* that KV of 560 tokens"),  # the size alone gives it away, before a byte is read
    (BOMB_BYTES // 1000, "not a safetensors file"),  # a range that could hold it: its header gives it away
])
def test_a_zip_bomb_is_refused_at_once_in_little_memory(engine, tmp_path, tokens, refusal):
    signature = engine.kv_signature()
    assert (max_chunk_bytes(signature, tokens) >= BOMB_BYTES) == (tokens > 560)
    bomb = _write_bomb(tmp_path / "bomb.igchat", signature, tokens)
    assert bomb.stat().st_size < BOMB_BYTES / 500
    store = SessionStore(tmp_path / "data")
    before = _files(store.data_dir)
    error, seconds, growth = _import_measured(store, bomb)
    assert growth < 50 * 2**20, growth / 2**20  # refused before the member is read (no timing: CI is shared)
    assert re.search(refusal, str(error)) and "nothing was imported" in str(error), error
    assert store.list() == [] and _files(store.data_dir) == before  # no session, no staged or moved file


def _patch_member(path, name, file_size, crc=None):
    """Rewrite the uncompressed size (and CRC) that the zip's local and central headers give for `name`."""
    data, encoded = bytearray(path.read_bytes()), name.encode()
    for signature, crc_at, size_at, name_at in ((b"PK\x03\x04", 14, 22, 30), (b"PK\x01\x02", 16, 24, 46)):
        at = data.find(signature)
        while data[at + name_at : at + name_at + len(encoded)] != encoded:
            at = data.find(signature, at + 1)
        struct.pack_into("<I", data, at + size_at, file_size)
        if crc is not None:
            struct.pack_into("<I", data, at + crc_at, crc)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("crc_forged_too", [False, True])
def test_a_forged_smaller_member_size_is_never_read_past(engine, tmp_path, crc_forged_too):
    """The zip says the chunk has its legitimate size; behind it lie 256 MB more of zeros. Reading stops at
    the declared size: the CRC then fails (refused as damaged), or, forged too, what was read is exactly
    the chunk the manifest vouches for, and that imports."""
    source = SessionStore(tmp_path / "source")
    session_id = _session(source, engine, "exact")
    exported = source.export(session_id, tmp_path / "good.igchat")
    with zipfile.ZipFile(exported) as good:
        entries = {name: good.read(name) for name in good.namelist()}
    name = "chunks/000001.safetensors"
    chunk = entries[name]
    forged = tmp_path / "forged.igchat"
    with zipfile.ZipFile(forged, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for other, data in entries.items():
            if other != name:
                archive.writestr(other, data)
        with archive.open(name, "w") as member:
            member.write(chunk)
            for _ in range(BOMB_BYTES // len(ZEROS)):
                member.write(ZEROS)
    _patch_member(forged, name, len(chunk), zlib.crc32(chunk) if crc_forged_too else None)

    store = SessionStore(tmp_path / "data")
    before = _files(store.data_dir)
    error, seconds, growth = _import_measured(store, forged)
    assert growth < 50 * 2**20, growth / 2**20  # refused before the member is read (no timing: CI is shared)
    if crc_forged_too:
        assert error is None
        (imported,) = store.list()
        assert [c.sha256 for c in store.chunks(imported.id)] == [c.sha256 for c in source.chunks(session_id)]
    else:
        assert "damaged" in str(error) and "nothing was imported" in str(error)
        assert store.list() == [] and _files(store.data_dir) == before


def _archive(path, entries, compression=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return path


def test_oversized_manifests_and_member_lists_are_refused(engine, tmp_path, monkeypatch):
    source = SessionStore(tmp_path / "source")
    exported = source.export(_session(source, engine, "int8"), tmp_path / "good.igchat")
    with zipfile.ZipFile(exported) as good:
        entries = {name: good.read(name) for name in good.namelist()}
    manifest = json.loads(entries["manifest.json"])
    store = SessionStore(tmp_path / "data")
    before = _files(store.data_dir)

    def refused(name, changed, message, compression=zipfile.ZIP_DEFLATED):
        path = _archive(tmp_path / f"{name}.igchat", {**entries, **changed}, compression)
        error, seconds, growth = _import_measured(store, path)
        assert error is not None and re.search(message, str(error)), (name, error)
        assert "nothing was imported" in str(error) and growth < 50 * 2**20, name

    huge_title = json.dumps({**manifest, "title": "x" * MAX_MANIFEST_BYTES}).encode()
    refused("huge_manifest", {"manifest.json": huge_title}, "manifest is larger than 4 MiB")
    brackets = json.dumps({**manifest, "settings": {"junk": [{}] * 300_000}}).encode()
    assert len(brackets) < MAX_MANIFEST_BYTES
    refused("brackets", {"manifest.json": brackets}, "more than 250000 lists and objects")
    refused("bzip2", {}, "compressed with a method", compression=zipfile.ZIP_BZIP2)
    # the zip's own size for the manifest lies (1 KB): reading stops there and the CRC gives it away
    lying = _archive(tmp_path / "lying.igchat", {**entries, "manifest.json": huge_title})
    _patch_member(lying, "manifest.json", 1024)
    error, _, _ = _import_measured(store, lying)
    assert "damaged" in str(error)

    monkeypatch.setattr(archive_module, "MAX_CHUNKS", 1)
    refused("too_many_chunks", {}, "lists 2 chunks, more than a session holds")
    monkeypatch.setattr(archive_module, "MAX_MEMBERS", 2)
    refused("too_many_members", {}, "lists 3 entries")
    assert store.list() == [] and _files(store.data_dir) == before


@pytest.mark.parametrize("kv_format", ["exact", "int8", "int8-partial-keys"])
def test_legitimate_exports_of_each_format_import_within_the_bound(engine, tmp_path, kv_format):
    source = SessionStore(tmp_path / "source")
    session_id = _session(source, engine, kv_format)
    signature = engine.kv_signature()
    for chunk in source.chunks(session_id):
        bound = max_chunk_bytes(signature, chunk.end - chunk.start)
        assert chunk.size <= bound
        if kv_format == "exact":  # float32 K/V and positions of every row: the bound less its header allowance
            assert chunk.size >= bound - _header_bound(signature)
    store = SessionStore(tmp_path / "data")
    imported = store.import_file(source.export(session_id, tmp_path / "chat.igchat"))
    assert [m.content for m in store.messages(imported)] == ["hello", "hi"]
    assert store.get(imported).token_count == engine.num_tokens
    for original, copy in zip(source.chunks(session_id), store.chunks(imported), strict=True):
        assert (copy.start, copy.end, copy.sha256, copy.size) == (original.start, original.end, original.sha256,
                                                                  original.size)
        expected, restored = read_chunk(source.data_dir, original, signature), read_chunk(store.data_dir, copy, signature)
        assert expected.keys() == restored.keys() and all(torch.equal(expected[k], restored[k]) for k in expected)
    if kv_format == "int8":  # format /5: float16 keys
        assert read_chunk(store.data_dir, store.chunks(imported)[0], signature)["k.0"].dtype == torch.float16
    if kv_format == "int8-partial-keys":  # format /4, as the previous version wrote it
        assert "k_channel_scale.0" in read_chunk(store.data_dir, store.chunks(imported)[0], signature)
        assert "pk.2" in read_chunk(store.data_dir, store.chunks(imported)[0], signature, engine.partial_key_digests())
    assert not [p for p in store.data_dir.iterdir() if p.name.startswith(".import-")]  # staging is gone


# ---- imports fit the model (issue 34) -------------------------------------------------------------------

def _rewritten(path, out, change):
    """A copy of the export at `path` whose manifest went through `change` (its chunks untouched)."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
            target.writestr(info.filename, data)
    return out


def test_a_session_beyond_the_loaded_models_window_is_refused_with_why(engine, tmp_path):
    source = SessionStore(tmp_path / "source")
    exported = source.export(_session(source, engine, "int8"), tmp_path / "chat.igchat")
    store = SessionStore(tmp_path / "data")
    before = _files(store.data_dir)
    with pytest.raises(ImportValidationError) as caught:
        archive_module.import_session(store, exported, archive_module.ImportLimits(window=512))
    assert str(caught.value) == ("cannot import this file: the session reaches token 560, beyond the loaded model's "
                                 "window of 512 tokens (it was made with a model of a longer window, or the file "
                                 "lies); nothing was imported")

    def lie(manifest):  # issue 34: a chunk declaring 0-1,000,000 for a model of 8,192
        manifest["messages"][-1]["token_end"] = 1_000_000
    lying = _rewritten(exported, tmp_path / "lying.igchat", lie)
    with pytest.raises(ImportValidationError, match="reaches token 1,000,000, beyond the loaded model's window of 8,192"):
        archive_module.import_session(store, lying, archive_module.ImportLimits(window=8192))
    assert store.list() == [] and _files(store.data_dir) == before
    imported = archive_module.import_session(store, exported, archive_module.ImportLimits(window=engine.num_tokens))
    assert store.get(imported).token_count == engine.num_tokens


def test_an_import_over_the_total_size_limit_is_refused_before_a_chunk_is_read(engine, tmp_path):
    source = SessionStore(tmp_path / "source")
    exported = source.export(_session(source, engine, "exact"), tmp_path / "chat.igchat")
    total = sum(c.size for c in source.chunks(source.list()[0].id))
    store = SessionStore(tmp_path / "data")
    with pytest.raises(ImportValidationError, match=f"hold {total:,} bytes, more than the {total - 1:,} an import may"):
        archive_module.import_session(store, exported, archive_module.ImportLimits(total_bytes=total - 1))
    assert store.list() == []
    archive_module.import_session(store, exported, archive_module.ImportLimits(total_bytes=total))
    with pytest.raises(ValueError, match="window"):
        archive_module.ImportLimits(window=0)


def test_staging_left_by_a_killed_import_is_removed_at_start(tmp_path):
    store = SessionStore(tmp_path / "data")
    left = store.data_dir / ".import-k9x2"
    left.mkdir()
    (left / "000000.safetensors").write_bytes(bytes(4096))
    kept = store.data_dir / "import-notes"  # not staging: only the staging prefix goes
    kept.mkdir()
    assert archive_module.remove_stale_staging(store.data_dir) == [left]
    assert not left.exists() and kept.is_dir()
