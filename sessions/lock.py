"""One writer per session: an exclusive, non-blocking flock on a per-session lock file.

flock conflicts between open file descriptions, so two processes and two tabs of one process are both
refused; the kernel drops the lock when its holder dies, so a killed app never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import SessionLockedError


def session_lock(data_dir: Path, session_id: str) -> "SessionLock":
    return SessionLock(data_dir / "locks" / f"{session_id}.lock")


class SessionLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it (this process's other windows count); False when held."""
        try:
            self.acquire()
        except SessionLockedError:
            return False
        return True

    def acquire(self) -> "SessionLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SessionLockedError(
                "this session is open elsewhere (another window or app process): close it there first"
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
