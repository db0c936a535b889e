"""KV snapshots: a session's pool as safetensors chunks, each a token range written once.

A chunk holds, for positions [start, end), the token ids and per layer the K/V rows and their positions.
Its metadata repeats the engine's KV signature (model fingerprint, dtype, geometry, skew), and the
database keeps its size and SHA-256; `read_chunk` checks all of it before any tensor reaches the engine.
Files are named by session and range and written atomically, so a crash leaves either the whole chunk
or nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .paths import atomic_write_bytes

CHUNK_FORMAT = "infinigen-kv-chunk/1"


class ChunkError(Exception):
    """A chunk cannot be used; the message says why (missing, damaged, foreign)."""


@dataclass(frozen=True)
class ChunkRecord:
    file: str  # relative to the data directory
    start: int
    end: int
    sha256: str
    size: int


def write_chunk(data_dir: Path, session_id: str, rows: dict[str, torch.Tensor], signature: dict[str, str],
                start: int) -> ChunkRecord:
    """Persist exported rows (engine.export_rows) for positions [start, start + len(token_ids))."""
    end = start + int(rows["token_ids"].numel())
    metadata = {"format": CHUNK_FORMAT, "start": str(start), "end": str(end), **signature}
    data = save_safetensors({name: t.contiguous() for name, t in rows.items()}, metadata=metadata)
    digest = hashlib.sha256(data).hexdigest()
    name = f"kv/{session_id}/{start:08d}-{end:08d}-{digest[:12]}.safetensors"
    atomic_write_bytes(data_dir / name, data)
    return ChunkRecord(name, start, end, digest, len(data))


def read_chunk(data_dir: Path, record: ChunkRecord, signature: dict[str, str]) -> dict[str, torch.Tensor]:
    return parse_chunk(read_chunk_bytes(data_dir, record), signature, record.start, record.end)


def read_chunk_bytes(data_dir: Path, record: ChunkRecord) -> bytes:
    """The chunk file's bytes, checked against the size and checksum on record (not yet decoded)."""
    try:
        data = (data_dir / record.file).read_bytes()
    except OSError as error:
        raise ChunkError(f"chunk {record.start}-{record.end} is missing ({error.strerror})") from error
    check_integrity(data, record.size, record.sha256, f"chunk {record.start}-{record.end}")
    return data


def check_integrity(data: bytes, size: int, sha256: str, what: str) -> None:
    if len(data) != size:
        raise ChunkError(f"{what} has {len(data)} bytes, expected {size}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ChunkError(f"{what} is damaged (checksum mismatch)")


def chunk_metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors blob, read from its JSON header alone."""
    import json
    import struct

    if len(data) < 8:
        raise ChunkError("not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8 or header_len > 100_000_000:
        raise ChunkError("not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except ValueError as error:
        raise ChunkError("not a safetensors file (unreadable header)") from error
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return metadata if isinstance(metadata, dict) else {}


def parse_chunk(data: bytes, signature: dict[str, str], start: int, end: int) -> dict[str, torch.Tensor]:
    """Decode and validate a chunk blob against the engine's signature and its expected range."""
    metadata = chunk_metadata(data)
    if metadata.get("format") != CHUNK_FORMAT:
        raise ChunkError("not a KV chunk of this application")
    for key, expected in signature.items():
        if metadata.get(key) != expected:
            raise ChunkError(f"chunk was made with another {key.replace('_', ' ')} ({metadata.get(key)!r})")
    if metadata.get("start") != str(start) or metadata.get("end") != str(end):
        raise ChunkError(f"chunk covers {metadata.get('start')}-{metadata.get('end')}, expected {start}-{end}")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise ChunkError(f"chunk {start}-{end} is unreadable: {error}") from error
    check_shapes(tensors, signature, start, end)
    return tensors


def check_shapes(tensors: dict[str, torch.Tensor], signature: dict[str, str], start: int, end: int) -> None:
    layers, heads, dim = (int(signature[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    dtype = getattr(torch, signature["dtype"])
    expected_names = {"token_ids"} | {f"{kind}.{l}" for l in range(layers) for kind in ("k", "v", "pos")}
    if set(tensors) != expected_names:
        raise ChunkError("chunk does not hold the expected tensors for this model")
    ids = tensors["token_ids"]
    if ids.dtype != torch.int64 or ids.shape != (end - start,):
        raise ChunkError("chunk token ids have the wrong shape")
    for layer in range(layers):
        keys, values, positions = tensors[f"k.{layer}"], tensors[f"v.{layer}"], tensors[f"pos.{layer}"]
        rows = positions.shape[0] if positions.dim() == 1 else -1
        if rows < 0 or rows > end - start or positions.dtype != torch.int64:
            raise ChunkError(f"chunk positions of layer {layer} are malformed")
        for tensor in (keys, values):
            if tensor.shape != (heads, rows, dim) or tensor.dtype != dtype:
                raise ChunkError(f"chunk K/V of layer {layer} have shape {tuple(tensor.shape)}, expected "
                                 f"{(heads, rows, dim)} {signature['dtype']}")
        if rows and (int(positions.min()) < start or int(positions.max()) >= end):
            raise ChunkError(f"chunk positions of layer {layer} fall outside {start}-{end}")
