"""Where sessions live: one data directory per user, holding the SQLite file and the KV chunks."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "INFINIGEN_DATA_DIR"


def default_data_dir() -> Path:
    """$INFINIGEN_DATA_DIR, else $XDG_DATA_HOME/infinigen-chat, else ~/.local/share/infinigen-chat."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "infinigen-chat"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file, fsync, rename, fsync the directory: the file is whole or absent. A write
    that fails (a full disk) removes its temporary file: what it had written would keep the disk full."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
