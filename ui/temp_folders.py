"""Temporary files a client can make the app write (exports, uploads), removed after use and at start.

    export_dir = fresh_export_folder()      # instead of tempfile.mkdtemp(prefix="infinigen-export-")
    remove_upload(path)                     # once an imported or attached upload has been read

Gradio keeps each upload in its cache folder (GRADIO_TEMP_DIR, by default <tmp>/gradio) until its own
`delete_cache` runs (ui/request_limits.UPLOAD_CACHE_CLEANUP), so an upload the app has used is removed at
once. An export folder lives as long as the app (the file must stay downloadable); one left by a killed
run is removed by the next start once it is older than `STALE_AFTER_S` (a running app's own folder is
fresh: it is touched at every export, and recreated by the export if another start removed it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

EXPORT_PREFIX = "infinigen-export-"
STALE_AFTER_S = 3600


def fresh_export_folder(parent: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> Path:
    """A new export folder in `parent` (the system's temp folder), removed when the app exits; export folders
    of earlier runs there, untouched for `stale_after_s`, are removed first."""
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    now = time.time()
    for folder in parent.glob(f"{EXPORT_PREFIX}*"):
        try:
            stale = folder.is_dir() and not folder.is_symlink() and now - _newest_change(folder) > stale_after_s
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=EXPORT_PREFIX, dir=parent))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _newest_change(folder: Path) -> float:
    return max([folder.stat().st_mtime] + [entry.stat().st_mtime for entry in folder.iterdir()])


def upload_cache() -> Path:
    """Where Gradio keeps uploads."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def remove_upload(path: str | os.PathLike[str], cache: Path | None = None) -> bool:
    """Remove an uploaded file and its folder (Gradio gives each upload a folder of its own) once the app has
    read it. Only a file inside the upload cache is touched, never a path a caller chose; returns whether
    anything was removed."""
    cache = (cache or upload_cache()).resolve()
    file = Path(path).resolve()
    if cache not in file.parents or not file.is_file():
        return False
    file.unlink(missing_ok=True)
    folder = file.parent
    if folder != cache and not any(folder.iterdir()):
        folder.rmdir()
    return True
