"""KV snapshots: a session's pool as safetensors chunks, each a token range written once.

A chunk holds, for positions [start, end), the token ids and per layer the K/V rows and their positions.
Its metadata repeats the engine's KV signature (model fingerprint, dtype, geometry, skew), and the
database keeps its size and SHA-256; `read_chunk` checks all of it before any tensor reaches the engine.
Files are named by session and range and written atomically, so a crash leaves either the whole chunk
or nothing.

The encodings, told apart by the `format` metadata, so every chunk says how to read it:

- `exact` (`infinigen-kv-chunk/1`, what every earlier version wrote): K/V rows in the engine's compute
  dtype, positions per layer. Restores bit for bit.
- `int8` (`infinigen-kv-chunk/5`, the default): keys in float16, values as int8 codes with one float16 scale per
  row of one head (max |x| / 127, symmetric), i.e. per token and head. The keys keep float16 because the
  attention logits see their rounding: int8 keys, even smoothed per channel (format /4 below), moved a resumed
  conversation's decoding ~10x more than float16 keys with int8 values do (issue 31, measured on the default
  model at 8k: mean KL to the uninterrupted conversation 9.2e-5 against 8.1e-6; docs/BENCHMARKS.md), while
  the values' rounding hardly shows. No partial keys are saved: the float16 keys rebuild them to float16's
  rounding, which selects as the saved ones did. A layer that holds every position of the chunk (no pool
  limit evicted anything) stores no position list. For SmolLM2-135M (30 layers, 3 KV heads of 64
  channels) that is 30 x 3 x (64 x 2 + 64 + 2) + 8 = 17,468 bytes per token against 46,329 exact, about
  what format /4 took (17,267).
- `int8-partial-keys` (`infinigen-kv-chunk/4`, the default before; read, and written by the resume benchmark
  and tests only): keys as int8 codes too. Keys have a few channels far larger than the rest, which would
  leave the others only a handful of int8 steps, so in a chunk of at least `KEY_SMOOTHING_MIN_ROWS` rows each
  key channel of a head is first divided by its largest magnitude in the chunk (`k_channel_scale.L`, float16
  [kv_heads, dim]); the per-token codes are taken of what remains and a key is codes * token scale * channel
  scale. Beside the rows, each sparse layer's InfiniGen partial keys as the live engine held them (`pk.L`,
  [kv_heads, rows, r] in the cache's own dtype, the same rows as `k.L`), with metadata `partial_keys` naming,
  per layer, a digest of the key projection they were made with (skew and chosen channels,
  policies/infinigen.py). A restore takes them as they are where the running policy's digest for that layer
  is the same, and otherwise recomputes them from the int8 keys: recomputed, the rounding moved which rows
  the rehearsal selects. The cost: r = partial_ratio x head_dim channels per sparse layer and KV head, 2
  bytes each in a float16 cache; for SmolLM2-135M 28 x 3 x 32 x 2 = 5,376 bytes per token on top of the
  rows' 11,890. A policy without partial keys (full, h2o) writes none.
- `int8` as earlier versions wrote it is still read: `infinigen-kv-chunk/3` (the /4 layout without partial
  keys, which a restore then recomputes) and `infinigen-kv-chunk/2` (per-token scales only).

Reading maps the file into memory: the checksum runs over the mapping and the tensors handed to the
engine are views of it, so the only copy is the one into the pool.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from infinigen_core.rows import (
    KEY_CHANNEL_SCALES,
    KEY_SCALES,
    KEYS,
    PARTIAL_KEYS,
    POSITIONS,
    TOKEN_IDS,
    VALUE_SCALES,
    VALUES,
    layers_in,
    tensor_name,
)

from .paths import atomic_write_bytes

EXACT_FORMAT = "infinigen-kv-chunk/1"
INT8_PER_TOKEN_FORMAT = "infinigen-kv-chunk/2"  # read, no longer written
INT8_REBUILT_FORMAT = "infinigen-kv-chunk/3"  # read, no longer written: no partial keys
INT8_PARTIAL_KEYS_FORMAT = "infinigen-kv-chunk/4"  # read, no longer written by the app: int8 keys, partial keys
INT8_FORMAT = "infinigen-kv-chunk/5"
KV_FORMATS = {"int8": INT8_FORMAT, "exact": EXACT_FORMAT}  # setting name -> chunk format written
# what the resume benchmark (and tests) can also write, to compare against: the previous defaults
BENCHMARK_FORMATS = {**KV_FORMATS, "int8-partial-keys": INT8_PARTIAL_KEYS_FORMAT, "int8-rebuilt": INT8_REBUILT_FORMAT,
                     "int8-per-token": INT8_PER_TOKEN_FORMAT}
_QUANTIZED_FORMATS = (INT8_FORMAT, INT8_PARTIAL_KEYS_FORMAT, INT8_REBUILT_FORMAT, INT8_PER_TOKEN_FORMAT)
_SMOOTHED_FORMATS = (INT8_PARTIAL_KEYS_FORMAT, INT8_REBUILT_FORMAT)
_HALF_KEY_FORMATS = (INT8_FORMAT,)  # keys in float16, only the values int8
_READABLE_FORMATS = (EXACT_FORMAT, *_QUANTIZED_FORMATS)
KEY_SMOOTHING_MIN_ROWS = 512  # from here the channel scales cost at most 0.4% of the key codes (2 bytes a channel)
INT8_MAX = 127
_SCALE_DTYPE = torch.float16
_MAX_HEADER_BYTES = 100_000_000
PARTIAL_KEYS_METADATA = "partial_keys"  # JSON {layer: digest} of the layers whose partial keys a chunk holds
_PARTIAL_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
                       "I32": torch.int32, "I8": torch.int8}


class ChunkError(Exception):
    """A chunk cannot be used; the message says why (missing, damaged, foreign)."""


@dataclass(frozen=True)
class ChunkRecord:
    file: str  # relative to the data directory
    start: int
    end: int
    sha256: str
    size: int


# ---------------------------------------------------------------------------------------------- writing
def write_chunk(data_dir: Path, session_id: str, rows: dict[str, torch.Tensor], signature: dict[str, str],
                start: int, kv_format: str = "int8", partial_keys: Mapping[int, str] | None = None) -> ChunkRecord:
    """Persist exported rows (engine.export_rows) for positions [start, start + len(token_ids)); `partial_keys`:
    the engine's partial_key_digests, for the partial keys the rows carry (only int8 writes them)."""
    end = start + int(rows[TOKEN_IDS].numel())
    return _write_blob(data_dir, session_id, start, end, encode_chunk(rows, signature, start, kv_format, partial_keys))


def resign_chunk(data_dir: Path, session_id: str, record: ChunkRecord, old_signature: dict[str, str],
                 new_signature: dict[str, str]) -> ChunkRecord:
    """A copy of a chunk, checked whole under `old_signature`, that names `new_signature` instead (for a pool
    an earlier version saved under another name for the same model). The old file is left for the caller."""
    data = map_chunk(data_dir, record)
    parse_chunk(data, old_signature, record.start, record.end)
    blob = save_safetensors(_tensor_views(data), metadata={**chunk_metadata(data), **new_signature})
    return _write_blob(data_dir, session_id, record.start, record.end, blob)


def _write_blob(data_dir: Path, session_id: str, start: int, end: int, data: bytes) -> ChunkRecord:
    digest = hashlib.sha256(data).hexdigest()
    name = f"kv/{session_id}/{start:08d}-{end:08d}-{digest[:12]}.safetensors"
    atomic_write_bytes(data_dir / name, data)
    return ChunkRecord(name, start, end, digest, len(data))


def encode_chunk(rows: dict[str, torch.Tensor], signature: dict[str, str], start: int, kv_format: str,
                 partial_keys: Mapping[int, str] | None = None) -> bytes:
    if kv_format not in BENCHMARK_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}: choose {' or '.join(KV_FORMATS)}")
    chunk_format = BENCHMARK_FORMATS[kv_format]
    end = start + int(rows[TOKEN_IDS].numel())
    metadata = {"format": chunk_format, "start": str(start), "end": str(end), **signature}
    carried = {name: t for name, t in rows.items() if name.startswith(PARTIAL_KEYS + ".")}
    rows = {name: t for name, t in rows.items() if name not in carried}
    tensors = rows if kv_format == "exact" else _int8_tensors(rows, start, end, chunk_format in _SMOOTHED_FORMATS,
                                                                 chunk_format in _HALF_KEY_FORMATS)
    if chunk_format == INT8_PARTIAL_KEYS_FORMAT and carried:
        digests = {}
        for name, partial in carried.items():
            layer = int(name.split(".")[1])
            if partial_keys is None or layer not in partial_keys:
                raise ValueError(f"the rows carry partial keys of layer {layer} without their digest")
            digests[str(layer)] = partial_keys[layer]
            tensors[name] = partial
        metadata[PARTIAL_KEYS_METADATA] = json.dumps(digests, sort_keys=True)
    return save_safetensors({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[heads, n, dim] -> (int8 codes [heads, n, dim], float16 scales [heads, n]); codes * scale ~ rows."""
    wide = rows.float()
    scale = (wide.abs().amax(dim=-1) / INT8_MAX).clamp(max=torch.finfo(_SCALE_DTYPE).max).to(_SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, codes are 0
    # quantise with the scale as stored, so decoding multiplies by exactly the divisor used here
    codes = (wide / scale.float().unsqueeze(-1)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def channel_scales(keys: torch.Tensor) -> torch.Tensor:
    """[heads, n, dim] -> float16 [heads, dim]: each channel's largest magnitude over the rows (1 where 0)."""
    scale = keys.float().abs().amax(dim=1).clamp(max=torch.finfo(_SCALE_DTYPE).max).to(_SCALE_DTYPE)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def holds_partial_keys(kv_format: str) -> bool:
    """Whether a chunk written in `kv_format` (a BENCHMARK_FORMATS name) keeps the partial keys rows carry."""
    return BENCHMARK_FORMATS.get(kv_format) == INT8_PARTIAL_KEYS_FORMAT


def _int8_tensors(rows: dict[str, torch.Tensor], start: int, end: int, smooth_keys: bool,
                  half_keys: bool = False) -> dict[str, torch.Tensor]:
    tensors = {TOKEN_IDS: rows[TOKEN_IDS]}
    every_position = torch.arange(start, end, dtype=torch.int64)
    half_max = torch.finfo(torch.float16).max
    for layer in range(layers_in(rows)):
        keys = rows[tensor_name(KEYS, layer)]
        if half_keys:
            tensors[tensor_name(KEYS, layer)] = keys.float().clamp(-half_max, half_max).to(torch.float16)
        else:
            if smooth_keys and keys.shape[1] >= KEY_SMOOTHING_MIN_ROWS:
                smoothing = tensors[tensor_name(KEY_CHANNEL_SCALES, layer)] = channel_scales(keys)
                keys = keys.float() / smoothing.float().unsqueeze(1)  # divided by the scale as stored
            tensors[tensor_name(KEYS, layer)], tensors[tensor_name(KEY_SCALES, layer)] = quantize_rows(keys)
        tensors[tensor_name(VALUES, layer)], tensors[tensor_name(VALUE_SCALES, layer)] = quantize_rows(
            rows[tensor_name(VALUES, layer)])
        positions = rows[tensor_name(POSITIONS, layer)]
        if not torch.equal(positions, every_position):
            tensors[tensor_name(POSITIONS, layer)] = positions
    return tensors


# ---------------------------------------------------------------------------------------------- reading
def read_chunk(data_dir: Path, record: ChunkRecord, signature: dict[str, str],
               partial_keys: Mapping[int, str] | None = None) -> dict[str, torch.Tensor]:
    """The chunk as engine.import_rows takes it: views of the memory-mapped file, checked end to end.

    K/V are either in the signature's dtype or int8 codes with `k_scale.L` / `v_scale.L` beside them (and,
    where the keys were smoothed, `k_channel_scale.L`); positions are always present (filled in where the
    file leaves them out). A layer's saved partial keys (`pk.L`) are kept only where `partial_keys` (the
    engine's partial_key_digests) names the digest they were made with; the others are left out, and
    the engine recomputes them.
    """
    return parse_chunk(map_chunk(data_dir, record), signature, record.start, record.end, partial_keys)


def _chunk_name(record: ChunkRecord) -> str:
    return f"chunk {record.start}-{record.end}"


def map_chunk(data_dir: Path, record: ChunkRecord, checksum: bool = True) -> memoryview:
    """The chunk file mapped read-only, checked against the size and (unless told not to) the checksum on
    record."""
    path = data_dir / record.file
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise ChunkError(f"chunk {record.start}-{record.end} has 0 bytes, expected {record.size}")
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise ChunkError(f"chunk {record.start}-{record.end} is missing ({error.strerror})") from error
    if hasattr(mapping, "madvise"):  # a cold file: ask for all of it at once rather than page by page
        mapping.madvise(mmap.MADV_WILLNEED)
    data = memoryview(mapping)
    if len(data) != record.size:
        raise ChunkError(f"{_chunk_name(record)} has {len(data)} bytes, expected {record.size}")
    if checksum and not checksum_matches(data, record):
        raise ChunkError(damage_reason(record))
    return data


def read_chunk_bytes(data_dir: Path, record: ChunkRecord) -> bytes:
    """The chunk file's bytes, checked against the size and checksum on record (not yet decoded)."""
    return bytes(map_chunk(data_dir, record))


def checksum_matches(data: bytes | memoryview, record: ChunkRecord) -> bool:
    """Whether a chunk's bytes have the SHA-256 on record (hashlib lets go of the interpreter while it reads)."""
    return hashlib.sha256(data).hexdigest() == record.sha256


def damage_reason(record: ChunkRecord) -> str:
    """What a chunk whose checksum does not match is called (a restore's reason to read the rest again)."""
    return f"{_chunk_name(record)} is damaged (checksum mismatch)"


def _header(data: bytes | memoryview) -> tuple[dict, int]:
    """A safetensors blob's JSON header and where its tensor bytes begin."""
    if len(data) < 8:
        raise ChunkError("not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8 or header_len > _MAX_HEADER_BYTES:
        raise ChunkError("not a safetensors file (bad header length)")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except ValueError as error:
        raise ChunkError("not a safetensors file (unreadable header)") from error
    if not isinstance(header, dict):
        raise ChunkError("not a safetensors file (header is not an object)")
    return header, 8 + header_len


def chunk_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The metadata of a safetensors blob, read from its JSON header alone."""
    metadata = _header(data)[0].get("__metadata__", {})
    return metadata if isinstance(metadata, dict) else {}


def _tensor_views(data: bytes | memoryview) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors blob as a read-only view of `data` (no copy)."""
    header, base = _header(data)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            first, last = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ChunkError(f"tensor {name!r} has a malformed or unsupported entry") from None
        count = 1
        for n in shape:
            count *= n
        item = torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= first <= last <= len(data) - base or last - first != count * item:
            raise ChunkError(f"tensor {name!r} lies outside the file or has the wrong size")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # the mapping is read-only; nothing writes through these views
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + first)
        tensors[name] = flat.view(shape)
    return tensors


def parse_chunk(data: bytes | memoryview, signature: dict[str, str], start: int, end: int,
                partial_keys: Mapping[int, str] | None = None) -> dict[str, torch.Tensor]:
    """Decode and validate a chunk blob against the engine's signature and its expected range; saved partial
    keys are kept where their digest is `partial_keys`' for the layer (read_chunk)."""
    metadata = chunk_metadata(data)
    kv_format = metadata.get("format")
    if kv_format not in _READABLE_FORMATS:
        raise ChunkError("not a KV chunk of this application")
    for key, expected in signature.items():
        if metadata.get(key) != expected:
            raise ChunkError(f"chunk was made with another {key.replace('_', ' ')} ({metadata.get(key)!r})")
    if metadata.get("start") != str(start) or metadata.get("end") != str(end):
        raise ChunkError(f"chunk covers {metadata.get('start')}-{metadata.get('end')}, expected {start}-{end}")
    tensors = _tensor_views(data)
    quantized = kv_format in _QUANTIZED_FORMATS
    if quantized:
        _fill_positions(tensors, signature, start, end)
    saved = (_partial_key_digests(metadata, int(signature["num_layers"])) if kv_format == INT8_PARTIAL_KEYS_FORMAT
             else {})
    check_shapes(tensors, signature, start, end, quantized, smoothed_keys=kv_format in _SMOOTHED_FORMATS,
                 partial_keys=saved, half_keys=kv_format in _HALF_KEY_FORMATS)
    for layer, digest in saved.items():
        if partial_keys is None or partial_keys.get(layer) != digest:
            del tensors[tensor_name(PARTIAL_KEYS, layer)]
    return tensors


def _partial_key_digests(metadata: dict[str, str], num_layers: int) -> dict[int, str]:
    """The `partial_keys` metadata of a chunk: {layer: digest}; {} where it has none."""
    text = metadata.get(PARTIAL_KEYS_METADATA)
    if text is None:
        return {}
    try:
        digests = json.loads(text)
        if not isinstance(digests, dict):
            raise ValueError
        saved = {int(layer): digest for layer, digest in digests.items()}
    except (ValueError, TypeError):
        raise ChunkError("chunk partial key digests are malformed") from None
    if not all(0 <= layer < num_layers and isinstance(digest, str) for layer, digest in saved.items()):
        raise ChunkError("chunk partial key digests are malformed")
    return saved


def _fill_positions(tensors: dict[str, torch.Tensor], signature: dict[str, str], start: int, end: int) -> None:
    every_position = torch.arange(start, end, dtype=torch.int64)
    for layer in range(int(signature["num_layers"])):
        tensors.setdefault(tensor_name(POSITIONS, layer), every_position)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in `tensor` (floating point): its smallest and largest values, one pass without a
    mask as large as the tensor (a NaN anywhere makes both NaN). ~20x faster than isfinite().all() on a 32k-token
    layer's float16 keys."""
    if not tensor.numel():
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def check_shapes(tensors: dict[str, torch.Tensor], signature: dict[str, str], start: int, end: int,
                 quantized: bool = False, smoothed_keys: bool = False,
                 partial_keys: Mapping[int, str] | None = None, half_keys: bool = False) -> None:
    """Every tensor a chunk must hold for this model, in its shape and dtype; `smoothed_keys`: a layer may
    also hold key channel scales (formats /3 and /4 write them for chunks of KEY_SMOOTHING_MIN_ROWS rows or
    more); `partial_keys`: the layers whose partial keys it must hold ([kv_heads, rows, r], one r for all);
    `half_keys`: (format /5) the keys are float16 without scales, only the values int8 codes."""
    layers, heads, dim = (int(signature[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    dtype = torch.int8 if quantized else getattr(torch, signature["dtype"])
    key_dtype = torch.float16 if half_keys else dtype
    # the int8-coded tensors, each with its scale per row and head
    coded: tuple[tuple[str, str], ...] = ((VALUES, VALUE_SCALES),) if half_keys else ((KEYS, KEY_SCALES),
                                                                                      (VALUES, VALUE_SCALES))
    coded = coded if quantized else ()
    kinds = (KEYS, VALUES, POSITIONS, *(scales for _, scales in coded))
    expected_names = {TOKEN_IDS} | {tensor_name(kind, l) for l in range(layers) for kind in kinds}
    partial_keys = partial_keys or {}
    expected_names |= {tensor_name(PARTIAL_KEYS, l) for l in partial_keys}
    smoothing = {tensor_name(KEY_CHANNEL_SCALES, l) for l in range(layers)} if smoothed_keys else set()
    if not expected_names <= set(tensors) <= expected_names | smoothing:
        raise ChunkError("chunk does not hold the expected tensors for this model")
    ids = tensors[TOKEN_IDS]
    if ids.dtype != torch.int64 or ids.shape != (end - start,):
        raise ChunkError("chunk token ids have the wrong shape")
    for layer in range(layers):
        keys, values, positions = (tensors[tensor_name(kind, layer)] for kind in (KEYS, VALUES, POSITIONS))
        rows = positions.shape[0] if positions.dim() == 1 else -1
        if rows < 0 or rows > end - start or positions.dtype != torch.int64:
            raise ChunkError(f"chunk positions of layer {layer} are malformed")
        for tensor, expected in ((keys, key_dtype), (values, dtype)):
            if tensor.shape != (heads, rows, dim) or tensor.dtype != expected:
                raise ChunkError(f"chunk K/V of layer {layer} have shape {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {(heads, rows, dim)} {expected}")
        if not all(all_finite(tensor) for tensor in (keys, values) if tensor.is_floating_point()):
            raise ChunkError(f"chunk K/V of layer {layer} hold a NaN or an infinity")
        if quantized:
            for kind, scales in coded:
                scale = tensors[tensor_name(scales, layer)]
                if scale.shape != (heads, rows) or scale.dtype != _SCALE_DTYPE or not all_finite(scale):
                    raise ChunkError(f"chunk {kind.upper()} scales of layer {layer} are malformed")
            smoothing_scales = tensors.get(tensor_name(KEY_CHANNEL_SCALES, layer))
            if smoothing_scales is not None and (smoothing_scales.shape != (heads, dim) or smoothing_scales.dtype != _SCALE_DTYPE
                                          or not all_finite(smoothing_scales)):
                raise ChunkError(f"chunk key channel scales of layer {layer} are malformed")
        if rows and (int(positions.min()) < start or int(positions.max()) >= end):
            raise ChunkError(f"chunk positions of layer {layer} fall outside {start}-{end}")
    channels = {tuple(tensors[tensor_name(PARTIAL_KEYS, l)].shape[2:]) for l in partial_keys}
    for layer in partial_keys:
        partial = tensors[tensor_name(PARTIAL_KEYS, layer)]
        rows = tensors[tensor_name(POSITIONS, layer)].shape[0]
        if (partial.dim() != 3 or partial.shape[:2] != (heads, rows) or not 0 < partial.shape[2] <= dim
                or len(channels) != 1 or partial.dtype not in _PARTIAL_KEY_DTYPES
                or not all_finite(partial)):
            raise ChunkError(f"chunk partial keys of layer {layer} are malformed")
