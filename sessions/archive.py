"""Export a session to one file and import it back, trusting nothing in the file.

The file is a zip archive holding `manifest.json` (title, system prompt, settings, messages, KV signature,
and per chunk its range, size and SHA-256) and `chunks/NNNNNN.safetensors`. Import accepts exactly those
names (no paths of its own choosing), checks every size before reading, every checksum and every tensor
shape against the manifest, and writes nothing until all of it has passed. Safetensors holds plain
tensors, so no pickle is ever loaded.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from .errors import ImportValidationError
from .paths import atomic_write_bytes
from .snapshots import ChunkError, ChunkRecord, check_integrity, parse_chunk, read_chunk_bytes

ARCHIVE_FORMAT = "infinigen-chat-session/1"
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_CHUNK_BYTES = 4 * 2**30
MAX_GEOMETRY = 4096  # layers, KV heads, head dimension: far above any model this app runs
SIGNATURE_KEYS = ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "skew")


def export_session(store, session_id: str, path: Path) -> Path:
    """Write the session to one file. A chunk that is missing or damaged on disk is left out with every
    chunk after it (the importer then re-reads those turns), so the export is always importable."""
    summary = store.get(session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
            exported = []
            for chunk in store.chunks(session_id):
                try:
                    data = read_chunk_bytes(store.data_dir, chunk)
                except ChunkError:
                    break
                archive.writestr(_chunk_name(len(exported)), data)
                exported.append({"start": chunk.start, "end": chunk.end, "sha256": chunk.sha256, "size": chunk.size})
            manifest = {
                "format": ARCHIVE_FORMAT,
                "title": summary.title,
                "system_prompt": summary.system_prompt,
                "settings": summary.settings,
                "model_fingerprint": summary.model_fingerprint,
                "signature": store.kv_signature(session_id) if exported else None,
                "messages": [{"role": m.role, "content": m.content, "token_start": m.token_start,
                              "token_end": m.token_end, "created": m.created} for m in store.messages(session_id)],
                "chunks": exported,
            }
            archive.writestr("manifest.json", json.dumps(manifest, indent=1))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _chunk_name(index: int) -> str:
    return f"chunks/{index:06d}.safetensors"


def _fail(message: str) -> ImportValidationError:
    return ImportValidationError(f"cannot import this file: {message}")


def _read_manifest(archive: zipfile.ZipFile) -> dict:
    try:
        info = archive.getinfo("manifest.json")
    except KeyError:
        raise _fail("it has no manifest.json (not an InfiniGen Chat export)") from None
    if info.file_size > MAX_MANIFEST_BYTES:
        raise _fail("its manifest is implausibly large")
    try:
        manifest = json.loads(archive.read(info).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, zipfile.BadZipFile) as error:
        raise _fail(f"its manifest is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        raise _fail(f"it is not an InfiniGen Chat session export (format {ARCHIVE_FORMAT})")
    _check_manifest_types(manifest)
    return manifest


def _check_manifest_types(manifest: dict) -> None:
    def expect(condition: bool, what: str) -> None:
        if not condition:
            raise _fail(f"its manifest has a malformed {what}")

    expect(isinstance(manifest.get("title"), str), "title")
    expect(isinstance(manifest.get("system_prompt"), str), "system prompt")
    expect(isinstance(manifest.get("settings"), dict), "settings")
    expect(isinstance(manifest.get("model_fingerprint"), str), "model fingerprint")
    messages, chunks, signature = manifest.get("messages"), manifest.get("chunks"), manifest.get("signature")
    expect(isinstance(messages, list), "message list")
    for m in messages:
        expect(isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
               and isinstance(m.get("token_start"), int) and isinstance(m.get("token_end"), int), "message")
    expect(isinstance(chunks, list), "chunk list")
    expected_start = 0
    for c in chunks:
        expect(isinstance(c, dict) and all(isinstance(c.get(k), int) for k in ("start", "end", "size"))
               and isinstance(c.get("sha256"), str) and len(c["sha256"]) == 64, "chunk entry")
        expect(c["start"] == expected_start and c["end"] > c["start"] and 0 < c["size"] <= MAX_CHUNK_BYTES,
               "chunk range")
        expected_start = c["end"]
    if chunks:
        expect(isinstance(signature, dict) and set(signature) == set(SIGNATURE_KEYS)
               and all(isinstance(v, str) for v in signature.values()), "KV signature")
        expect(signature["dtype"] in ("float32", "float16", "bfloat16"), "KV dtype")
        expect(all(signature[k].isascii() and signature[k].isdecimal() and 0 < int(signature[k]) <= MAX_GEOMETRY
                   for k in ("num_layers", "num_kv_heads", "head_dim")), "KV geometry")


def import_session(store, path: Path) -> str:
    """Validate the whole file, then write it as a new session; returns the new session's id.

    Chunks are read one at a time in both passes, so memory stays at one chunk whatever the file's size.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise _fail(f"it is not a session export ({error})") from None
    with archive:
        try:
            manifest = _read_manifest(archive)
            _check_entries(archive, manifest)
            for index, entry in enumerate(manifest["chunks"]):
                _read_valid_chunk(archive, index, entry, manifest["signature"], parse=True)
        except ImportValidationError:
            raise
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError) as error:
            # a damaged archive (bad CRC, truncated member) or a value the checks above did not foresee
            raise _fail(f"it is damaged ({error})") from None
        return _write_imported(store, manifest, lambda index, entry: _read_valid_chunk(
            archive, index, entry, manifest["signature"], parse=False))


def _check_entries(archive: zipfile.ZipFile, manifest: dict) -> None:
    expected_names = {"manifest.json"} | {_chunk_name(i) for i in range(len(manifest["chunks"]))}
    names = set(archive.namelist())
    if names != expected_names:
        strange = sorted(names - expected_names)[:3] or sorted(expected_names - names)[:3]
        raise _fail(f"it holds unexpected or missing entries: {strange}")
    for index, entry in enumerate(manifest["chunks"]):
        info = archive.getinfo(_chunk_name(index))
        if info.file_size != entry["size"]:
            raise _fail(f"chunk {index} has {info.file_size} bytes, the manifest says {entry['size']}")


def _read_valid_chunk(archive: zipfile.ZipFile, index: int, entry: dict, signature: dict, parse: bool) -> bytes:
    data = archive.read(_chunk_name(index))
    try:
        check_integrity(data, entry["size"], entry["sha256"], "its data")
        if parse:
            parse_chunk(data, signature, entry["start"], entry["end"])
    except ChunkError as error:
        raise _fail(f"chunk {index}: {error}") from None
    return data


def _write_imported(store, manifest: dict, read_chunk_data) -> str:
    session_id = store.create(manifest["title"] or "Imported chat", manifest["system_prompt"], manifest["settings"],
                              manifest["model_fingerprint"])
    try:
        for m in manifest["messages"]:
            store.add_message(session_id, m["role"], m["content"], m["token_start"], m["token_end"])
        for index, entry in enumerate(manifest["chunks"]):
            data = read_chunk_data(index, entry)  # checked again: the file may have changed since validation
            name = f"kv/{session_id}/{entry['start']:08d}-{entry['end']:08d}-{entry['sha256'][:12]}.safetensors"
            atomic_write_bytes(store.data_dir / name, data)
            record = ChunkRecord(name, entry["start"], entry["end"], entry["sha256"], entry["size"])
            store.add_chunk(session_id, record, manifest["signature"], entry["end"])
    except BaseException:
        store.delete(session_id)
        raise
    return session_id
