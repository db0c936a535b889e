"""How sessions keep their KV on disk: the chunk format and the disk budget, validated in one place.

    StorageConfig()                                   # int8 chunks, budget: a quarter of the free space
    StorageConfig(kv_format="exact", kv_disk_limit=parse_size("20GiB"))
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from infinigen_core.config import BYTE_UNITS, split_size

from .snapshots import KV_FORMATS

DEFAULT_FREE_FRACTION = 0.25  # of (free space + what the chunks already take): room left for everything else


def parse_size(text: str | int) -> int:
    """'20GiB' -> 21474836480, '500MB' -> 500000000, '1048576' -> 1048576 (bytes)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    parsed = split_size(text)
    if parsed is None or parsed[1] not in BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size: use bytes like 20GiB, 500MB or 1048576")
    return int(parsed[0] * BYTE_UNITS[parsed[1]])


def format_size(size: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class StorageConfig:
    kv_format: str = "int8"  # "int8" (compact, default) or "exact" (bit for bit)
    kv_disk_limit: int | None = None  # bytes for all sessions' KV chunks; None: DEFAULT_FREE_FRACTION

    def __post_init__(self) -> None:
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"unknown KV format {self.kv_format!r}: choose {' or '.join(KV_FORMATS)}")
        if self.kv_disk_limit is not None and (not isinstance(self.kv_disk_limit, int) or self.kv_disk_limit < 0):
            raise ValueError(f"the KV disk limit must be a byte count >= 0, got {self.kv_disk_limit!r}")

    def limit_bytes(self, data_dir: Path, used_bytes: int) -> int:
        """The budget now: the set limit, else a fraction of what the chunks could grow into."""
        if self.kv_disk_limit is not None:
            return self.kv_disk_limit
        return int(DEFAULT_FREE_FRACTION * (shutil.disk_usage(data_dir).free + used_bytes))

    def describe(self) -> str:
        limit = format_size(self.kv_disk_limit) if self.kv_disk_limit is not None else \
            f"{DEFAULT_FREE_FRACTION:.0%} of the free space"
        return f"{self.kv_format} KV chunks, at most {limit}"
