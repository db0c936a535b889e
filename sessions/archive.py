"""Export a session to one file and import it back, trusting nothing in the file.

The file is a zip archive holding `manifest.json` (title, system prompt, settings, messages, KV signature,
and per chunk its range, size and SHA-256) and `chunks/NNNNNN.safetensors`. Import accepts exactly those
names (no paths of its own choosing), checks every size before reading, every checksum and every tensor
shape against the manifest, and writes nothing until all of it has passed. Safetensors holds plain
tensors, so no pickle is ever loaded.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

from .errors import ImportValidationError
from .paths import atomic_write_bytes
from .snapshots import ChunkError, ChunkRecord, parse_chunk

ARCHIVE_FORMAT = "infinigen-chat-session/1"
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_CHUNK_BYTES = 4 * 2**30
SIGNATURE_KEYS = ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "skew")


def export_session(store, session_id: str, path: Path) -> Path:
    summary = store.get(session_id)
    chunks = store.chunks(session_id)
    manifest = {
        "format": ARCHIVE_FORMAT,
        "title": summary.title,
        "system_prompt": summary.system_prompt,
        "settings": summary.settings,
        "model_fingerprint": summary.model_fingerprint,
        "signature": store.kv_signature(session_id),
        "messages": [{"role": m.role, "content": m.content, "token_start": m.token_start,
                      "token_end": m.token_end, "created": m.created} for m in store.messages(session_id)],
        "chunks": [{"start": c.start, "end": c.end, "sha256": c.sha256, "size": c.size} for c in chunks],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("manifest.json", json.dumps(manifest, indent=1))
        for index, chunk in enumerate(chunks):
            archive.write(store.data_dir / chunk.file, _chunk_name(index))
    tmp.replace(path)
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
        expect(all(signature[k].isdigit() for k in ("num_layers", "num_kv_heads", "head_dim")), "KV geometry")


def import_session(store, path: Path) -> str:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise _fail(f"it is not a session export ({error})") from None
    with archive:
        manifest = _read_manifest(archive)
        expected_names = {"manifest.json"} | {_chunk_name(i) for i in range(len(manifest["chunks"]))}
        names = set(archive.namelist())
        if names != expected_names:
            strange = sorted(names - expected_names)[:3] or sorted(expected_names - names)[:3]
            raise _fail(f"it holds unexpected or missing entries: {strange}")
        blobs = []
        for index, entry in enumerate(manifest["chunks"]):
            info = archive.getinfo(_chunk_name(index))
            if info.file_size != entry["size"]:
                raise _fail(f"chunk {index} has {info.file_size} bytes, the manifest says {entry['size']}")
            data = archive.read(info)
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise _fail(f"chunk {index} is damaged (checksum mismatch)")
            try:
                parse_chunk(data, manifest["signature"], entry["start"], entry["end"])
            except ChunkError as error:
                raise _fail(f"chunk {index}: {error}") from None
            blobs.append((entry, data))
    return _write_imported(store, manifest, blobs)


def _write_imported(store, manifest: dict, blobs: list[tuple[dict, bytes]]) -> str:
    session_id = store.create(manifest["title"] or "Imported chat", manifest["system_prompt"], manifest["settings"],
                              manifest["model_fingerprint"])
    try:
        for m in manifest["messages"]:
            store.add_message(session_id, m["role"], m["content"], m["token_start"], m["token_end"])
        for entry, data in blobs:
            name = f"kv/{session_id}/{entry['start']:08d}-{entry['end']:08d}-{entry['sha256'][:12]}.safetensors"
            atomic_write_bytes(store.data_dir / name, data)
            record = ChunkRecord(name, entry["start"], entry["end"], entry["sha256"], entry["size"])
            store.add_chunk(session_id, record, manifest["signature"], entry["end"])
    except BaseException:
        store.delete(session_id)
        raise
    return session_id
