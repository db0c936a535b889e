"""Export a session to one file and import it back, trusting nothing in the file.

The file is a zip archive holding `manifest.json` (title, system prompt, settings, messages, KV signature,
and per chunk its range, size and SHA-256) and `chunks/NNNNNN.safetensors`. Import accepts exactly those
names (no paths of its own choosing) and writes nothing until all of it has passed. Safetensors holds plain
tensors, so no pickle is ever loaded.

A file may lie about everything, so import never holds more than a bounded piece of it in memory (a
compressed member can unpack to thousands of times its size): the central directory and the member count
are checked before the zip is opened, the manifest's size before it is parsed, and each chunk's size
against the largest its token range can take for the manifest's KV geometry (`max_chunk_bytes`) before a
byte of it is read. A chunk's safetensors header is screened first; then the chunk streams to a staging
folder beside the database, hashed on the way and never read past its declared size, and is checked there
(memory-mapped) before the session is created. The staged files are then moved into place, so a refusal
leaves neither a session nor a file behind.

What the loaded model can use bounds an import too (`ImportLimits`): a chunk that reaches past the model's
window (a file may declare 0-1,000,000 tokens for a model of 8,192) is refused with why, and so is a file
whose chunks add up to more than `total_bytes`. A staging folder left by a crash is removed by
`remove_stale_staging` when the app starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ImportValidationError
from .snapshots import (
    EXACT_FORMAT,
    INT8_FORMAT,
    INT8_PARTIAL_KEYS_FORMAT,
    INT8_PER_TOKEN_FORMAT,
    INT8_REBUILT_FORMAT,
    ChunkError,
    ChunkRecord,
    parse_chunk,
    read_chunk_bytes,
)

ARCHIVE_FORMAT = "infinigen-chat-session/1"
# A manifest holds the history that fits one context window (the app drops the oldest turns beyond it): a
# 128k-token window is about 1 MB of JSON. Parsing costs up to ~24 bytes of Python objects per byte of
# tiny containers ("[{},{},...]"), so their number is bounded too.
MAX_MANIFEST_BYTES = 4 * 2**20
MAX_MANIFEST_CONTAINERS = 250_000  # "[" and "{" in the text, strings included: at most ~18 MB once parsed
MAX_CHUNKS = 20_000  # two per turn (prompt, reply)
MAX_ATTACHMENTS = 64  # files attached to one message
MAX_MEMBERS = MAX_CHUNKS + 1
MAX_CENTRAL_DIRECTORY_BYTES = MAX_MEMBERS * 256  # an entry is 46 bytes + its name (25) + a zip64 extra (28)
MAX_CHUNK_BYTES = 4 * 2**30
MAX_GEOMETRY = 4096  # layers, KV heads, head dimension: far above any model this app runs
MAX_KV_WIDTH = 2**21  # layers x KV heads x head dim: OPT-175B (96 x 96 x 128) has 1.18M, Llama-3-405B 129k
HEADER_ALLOWANCE = 64 * 2**10  # a chunk's safetensors header: its metadata, beside the signature's strings
PER_TENSOR_ALLOWANCE = 256  # '"k_channel_scale.4095":{"dtype":"F16","shape":[...],"data_offsets":[...]},'
PARTIAL_KEY_DIGEST_ALLOWANCE = 64  # a layer's '"4095": "<16 hex digits>", ' in the partial_keys metadata, escaped
COPY_BLOCK = 2**20
SIGNATURE_KEYS = ("model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "skew")
_CHUNK_FORMATS = (EXACT_FORMAT, INT8_FORMAT, INT8_PARTIAL_KEYS_FORMAT, INT8_REBUILT_FORMAT, INT8_PER_TOKEN_FORMAT)
# what export writes (stored) or a zip tool may (deflate); both unpack a bounded amount per read, which
# Python's bzip2 and LZMA readers do not
_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STAGING_PREFIX = ".import-"


@dataclass(frozen=True)
class ImportLimits:
    """What an imported session may hold. `window`: the loaded model's context window in tokens (None: not
    known, only the file's own consistency is checked); `total_bytes`: all of its KV chunks together, the same
    bound as an upload's (ui/request_limits.py). A full 8,192-token window of the default model is ~143 MB in
    int8 (17,469 bytes a token: float16 keys, int8 values) and ~380 MB exact in float32."""

    window: int | None = None
    total_bytes: int = 2**30

    def __post_init__(self) -> None:
        if self.window is not None and self.window <= 0:
            raise ValueError(f"ImportLimits.window must be positive or None, got {self.window}")
        if self.total_bytes <= 0:
            raise ValueError(f"ImportLimits.total_bytes must be positive, got {self.total_bytes}")


def max_chunk_bytes(signature: dict[str, str], tokens: int) -> int:
    """The largest a chunk file of `tokens` positions can legitimately be under `signature` (checked), in
    any format sessions/snapshots.py writes or reads, with every layer holding every position.

    Per layer: exact holds K and V in the signature's dtype [heads, n, dim] and int64 positions [n]; int8
    holds int8 codes for both, float16 per-row scales [heads, n] for both, optional positions and float16
    key channel scales [heads, dim], and (format /4) perhaps partial keys [heads, n, r <= dim] of up to 4
    bytes (format /5, float16 keys and int8 values with their scales, is smaller than that). Beside them: int64 token ids [n] and the JSON header. (snapshots.py validates this layout in
    check_shapes but has no function that sizes it, hence the sum here.)
    """
    layers, heads, dim = (int(signature[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    item = _itemsize(_KV_DTYPES[signature["dtype"]])
    exact_row = 2 * dim * item
    int8_row = 2 * dim * _itemsize(torch.int8) + 2 * _itemsize(torch.float16) + dim * _itemsize(torch.float32)
    per_layer = (heads * tokens * max(exact_row, int8_row) + heads * dim * _itemsize(torch.float16)
                 + tokens * _itemsize(torch.int64))
    return 8 + _header_bound(signature) + tokens * _itemsize(torch.int64) + layers * per_layer


def _header_bound(signature: dict[str, str]) -> int:
    layers = int(signature["num_layers"])
    tensors = 1 + 7 * layers  # token ids; k, v, pos, k_scale, v_scale, k_channel_scale, pk
    return (HEADER_ALLOWANCE + sum(len(v) for v in signature.values()) + PER_TENSOR_ALLOWANCE * tensors
            + PARTIAL_KEY_DIGEST_ALLOWANCE * layers)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def export_session(store, session_id: str, path: Path) -> Path:
    """Write the session to one file. A chunk that is missing or damaged on disk is left out with every
    chunk after it (the importer then re-reads those turns), so the export is always importable."""
    summary = store.get(session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
            exported: list[dict[str, object]] = []
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
                              "token_end": m.token_end, "created": m.created,
                              **({"attachments": list(m.attachments)} if m.attachments else {})}
                             for m in store.messages(session_id)],
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
    return ImportValidationError(f"cannot import this file: {message}; nothing was imported")


def _check_directory(path: Path) -> None:
    """Refuse a zip whose central directory is too large before zipfile reads it (it reads it whole and
    makes an object per entry)."""
    try:
        with open(path, "rb") as handle:
            # the function ZipFile itself uses, so the figures checked are the ones it will trust (zip64 too)
            end = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
    except OSError as error:
        raise _fail(f"it cannot be read ({error.strerror})") from None
    if not end:
        return  # not a zip at all: ZipFile says so
    entries, size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
    if entries > MAX_MEMBERS or size > MAX_CENTRAL_DIRECTORY_BYTES:
        raise _fail(f"it lists {entries} entries in {size} bytes, "
                    f"more than a session export holds (at most {MAX_CHUNKS} chunks)")


def _open_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo):
    if info.compress_type not in _COMPRESSIONS:
        raise _fail(f"{info.filename} is compressed with a method session exports do not use")
    return archive.open(info)


def _read_manifest(archive: zipfile.ZipFile) -> dict:
    try:
        info = archive.getinfo("manifest.json")
    except KeyError:
        raise _fail("it has no manifest.json (not an InfiniGen Chat export)") from None
    too_large = f"its manifest is larger than {MAX_MANIFEST_BYTES // 2**20} MiB, far more than a session needs"
    if info.file_size > MAX_MANIFEST_BYTES:
        raise _fail(too_large)
    with _open_member(archive, info) as stream:
        raw = stream.read(MAX_MANIFEST_BYTES + 1)  # never more, whatever the zip declares
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _fail(too_large)
    if raw.count(b"[") + raw.count(b"{") > MAX_MANIFEST_CONTAINERS:
        raise _fail(f"its manifest holds more than {MAX_MANIFEST_CONTAINERS} lists and objects")
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
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
    # the manifest is untrusted JSON: each part is checked before it is used as what it should be
    messages: Any = manifest.get("messages")
    chunks: Any = manifest.get("chunks")
    signature: Any = manifest.get("signature")
    expect(isinstance(messages, list), "message list")
    for m in messages:
        expect(isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
               and isinstance(m.get("token_start"), int) and isinstance(m.get("token_end"), int), "message")
        # attachment records (issue 20); an archive from before them has none
        attached = m.get("attachments", [])
        expect(isinstance(attached, list) and len(attached) <= MAX_ATTACHMENTS
               and all(isinstance(a, dict) and all(isinstance(k, str) and isinstance(v, (str, int, type(None)))
                                                   for k, v in a.items()) for a in attached), "attachment list")
    expect(isinstance(chunks, list), "chunk list")
    if len(chunks) > MAX_CHUNKS:
        raise _fail(f"its manifest lists {len(chunks)} chunks, more than a session holds ({MAX_CHUNKS})")
    if chunks:
        expect(isinstance(signature, dict) and set(signature) == set(SIGNATURE_KEYS)
               and all(isinstance(v, str) for v in signature.values()), "KV signature")
        expect(signature["dtype"] in _KV_DTYPES, "KV dtype")
        expect(all(signature[k].isascii() and signature[k].isdecimal() and 0 < int(signature[k]) <= MAX_GEOMETRY
                   for k in ("num_layers", "num_kv_heads", "head_dim")), "KV geometry")
        width = int(signature["num_layers"]) * int(signature["num_kv_heads"]) * int(signature["head_dim"])
        expect(width <= MAX_KV_WIDTH, "KV geometry")
    expected_start = 0
    for index, c in enumerate(chunks):
        expect(isinstance(c, dict) and all(type(c.get(k)) is int for k in ("start", "end", "size"))
               and isinstance(c.get("sha256"), str) and len(c["sha256"]) == 64, "chunk entry")
        expect(c["start"] == expected_start and c["end"] > c["start"] and 0 < c["size"] <= MAX_CHUNK_BYTES,
               "chunk range")
        expected_start = c["end"]
        bound = max_chunk_bytes(signature, c["end"] - c["start"])
        if c["size"] > bound:
            raise _fail(f"chunk {index} declares {c['size']} bytes, more than the {bound} that KV of "
                        f"{c['end'] - c['start']} tokens of its model can take")


def import_session(store, path: Path, limits: ImportLimits = ImportLimits()) -> str:
    """Validate the whole file, then write it as a new session; returns the new session's id.

    Memory holds the manifest and one block of one chunk at a time, whatever the file's size or claims;
    chunks wait in a staging folder in the data directory until all have passed.
    """
    _check_directory(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise _fail(f"it is not a session export ({error})") from None
    with archive:
        with _damage_refused():
            manifest = _read_manifest(archive)
            _check_fits(manifest, limits)
            _check_entries(archive, manifest)
            _check_free_space(store.data_dir, manifest)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=store.data_dir))
        try:
            with _damage_refused():
                staged = [_stage_chunk(archive, index, entry, manifest["signature"], staging)
                          for index, entry in enumerate(manifest["chunks"])]
            return _write_imported(store, manifest, staged)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def remove_stale_staging(data_dir: Path) -> list[Path]:
    """Remove the staging folders an import left when the process was killed (they hold chunks no session
    names); call it when the app starts, before any import can run. Returns what was removed."""
    removed = []
    for folder in Path(data_dir).glob(f"{STAGING_PREFIX}*"):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _check_fits(manifest: dict, limits: ImportLimits) -> None:
    """The session against the loaded model and the size limit, before a byte of KV is read."""
    chunks, messages = manifest["chunks"], manifest["messages"]
    tokens = max([c["end"] for c in chunks] + [m["token_end"] for m in messages] + [0])
    if limits.window is not None and tokens > limits.window:
        raise _fail(f"the session reaches token {tokens:,}, beyond the loaded model's window of "
                    f"{limits.window:,} tokens (it was made with a model of a longer window, or the file lies)")
    total = sum(c["size"] for c in chunks)
    if total > limits.total_bytes:
        raise _fail(f"its KV chunks hold {total:,} bytes, more than the {limits.total_bytes:,} an import may "
                    f"({limits.total_bytes / 2**20:,.0f} MiB)")


@contextlib.contextmanager
def _damage_refused():
    """A damaged archive (bad CRC, truncated member) or a value the checks did not foresee: a refusal."""
    try:
        yield
    except ImportValidationError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError) as error:
        raise _fail(f"it is damaged ({error})") from None


def _check_entries(archive: zipfile.ZipFile, manifest: dict) -> None:
    expected_names = {"manifest.json"} | {_chunk_name(i) for i in range(len(manifest["chunks"]))}
    names = set(archive.namelist())
    if names != expected_names or len(archive.infolist()) != len(expected_names):
        strange = sorted(names - expected_names)[:3] or sorted(expected_names - names)[:3] or "a name twice"
        raise _fail(f"it holds unexpected or missing entries: {strange}")
    for index, entry in enumerate(manifest["chunks"]):
        info = archive.getinfo(_chunk_name(index))
        if info.file_size != entry["size"]:
            raise _fail(f"chunk {index} has {info.file_size} bytes, the manifest says {entry['size']}")


def _check_free_space(data_dir: Path, manifest: dict) -> None:
    needed, free = sum(c["size"] for c in manifest["chunks"]), shutil.disk_usage(data_dir).free
    if needed > free:
        raise _fail(f"its KV chunks need {needed} bytes of disk, {free} are free")


def _stage_chunk(archive: zipfile.ZipFile, index: int, entry: dict, signature: dict, staging: Path) -> Path:
    """Copy a chunk to `staging` and check it there: its header before its data is read, its size and
    checksum as it streams, its tensors once it is whole. Returns the staged file."""
    size, path, digest = entry["size"], staging / f"{index:06d}.safetensors", hashlib.sha256()
    with _open_member(archive, archive.getinfo(_chunk_name(index))) as stream, open(path, "wb") as out:
        head = stream.read(min(size, 8 + _header_bound(signature)))  # all of the header if it is honest
        remaining = size - len(head)
        if remaining == 0:  # a small chunk is whole already: a damaged one is told as such
            _check_digest(hashlib.sha256(head), entry, index)
        problem = _header_problem(head, size, signature, entry["start"], entry["end"])
        if problem:
            raise _fail(f"chunk {index} {problem}")
        digest.update(head)
        out.write(head)
        while remaining > 0:
            block = stream.read(min(COPY_BLOCK, remaining))
            if not block:
                raise _fail(f"chunk {index} ends {remaining} bytes short of its declared {size}")
            digest.update(block)
            out.write(block)
            remaining -= len(block)
        if stream.read(1):
            raise _fail(f"chunk {index} holds more than its declared {size} bytes")
        out.flush()
        os.fsync(out.fileno())
    _check_digest(digest, entry, index)
    _check_tensors(path, index, signature, entry["start"], entry["end"])
    return path


def _check_digest(digest, entry: dict, index: int) -> None:
    if digest.hexdigest() != entry["sha256"]:
        raise _fail(f"chunk {index} is damaged (checksum mismatch)")


def _header_problem(head: bytes, size: int, signature: dict, start: int, end: int) -> str | None:
    """Why a chunk's safetensors header rules it out, read before its data; None if it may be right. The
    full check (every tensor's shape, the values) runs once the chunk is on disk."""
    header_length = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if not 0 < header_length <= len(head) - 8:
        return "is not a safetensors file (bad header length)"
    try:
        header = json.loads(head[8 : 8 + header_length])
        metadata = header.pop("__metadata__", {})
        data_end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "is not a safetensors file (unreadable header)"
    if not isinstance(metadata, dict) or metadata.get("format") not in _CHUNK_FORMATS:
        return "is not a KV chunk of this application"
    for key, expected in signature.items():
        if metadata.get(key) != expected:
            return f"was made with another {key.replace('_', ' ')} ({metadata.get(key)!r}) than the manifest's"
    if metadata.get("start") != str(start) or metadata.get("end") != str(end):
        return f"covers {metadata.get('start')}-{metadata.get('end')}, expected {start}-{end}"
    if 8 + header_length + data_end != size:
        return f"declares tensors of {data_end} bytes, which does not fill its {size} bytes"
    return None


def _check_tensors(path: Path, index: int, signature: dict, start: int, end: int) -> None:
    """parse_chunk over the staged file, memory-mapped: only the pages it inspects are read."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        view = memoryview(mapping)
        try:
            parse_chunk(view, signature, start, end)  # the tensors, views of the mapping, are dropped at once
            problem = None
        except ChunkError as error:
            problem = str(error)
        view.release()
    if problem:
        raise _fail(f"chunk {index}: {problem}")


def _write_imported(store, manifest: dict, staged: list[Path]) -> str:
    """Create the session from checked parts: staged chunk files are moved (not copied) into its folder and
    made durable before the database names them. On any failure the session and its files go."""
    session_id = store.create(manifest["title"] or "Imported chat", manifest["system_prompt"], manifest["settings"],
                              manifest["model_fingerprint"])
    folder, moved = store.data_dir / "kv" / session_id, []
    try:
        store.add_messages(session_id, [(m["role"], m["content"], m["token_start"], m["token_end"],
                                         m.get("attachments", [])) for m in manifest["messages"]])
        records = []
        for source, entry in zip(staged, manifest["chunks"]):
            name = f"kv/{session_id}/{entry['start']:08d}-{entry['end']:08d}-{entry['sha256'][:12]}.safetensors"
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(source, store.data_dir / name)
            moved.append(store.data_dir / name)
            records.append(ChunkRecord(name, entry["start"], entry["end"], entry["sha256"], entry["size"]))
        if moved:
            _fsync_directory(folder)
        for record in records:
            store.add_chunk(session_id, record, manifest["signature"], record.end)
    except BaseException:
        store.delete(session_id)
        for path in moved:  # those not yet registered, which delete does not know of
            path.unlink(missing_ok=True)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise
    return session_id


def _fsync_directory(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
