"""Temporary files a client can make the app write (exports, uploads), removed after use and at start.

    export_dir = fresh_export_folder()      # instead of tempfile.mkdtemp(prefix="infinigen-export-")
    os.environ.setdefault("GRADIO_TEMP_DIR", str(fresh_upload_folder()))   # before gradio is imported
    remove_upload(path)                     # once an imported or attached upload has been read

Gradio keeps each upload in its cache folder (GRADIO_TEMP_DIR: the app gives each run its own, unless the
user set one) until its own `delete_cache` runs (ui/request_limits.UPLOAD_CACHE_CLEANUP), so an upload the
app has used is removed at once; the folder goes when the app exits, or at the next start after a kill. An export folder lives as long as the app (the file must stay downloadable); one left by a killed
run is removed by the next start: its name carries its app's process id, and that process is gone (a
folder without one, or whose id another process now has, once it is older than `STALE_AFTER_S`; a running
app's own folder is fresh: it is touched at every export, and recreated by the export if another start
removed it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

EXPORT_PREFIX = "infinigen-export-"
UPLOAD_PREFIX = "infinigen-uploads-"
STALE_AFTER_S = 3600


def fresh_export_folder(parent: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> Path:
    """A new export folder in `parent` (the system's temp folder), removed when the app exits; export folders
    of earlier runs there are removed first: one whose app is gone (its name carries the process id), or one
    untouched for `stale_after_s` (a name without an id, or an id since taken by another process)."""
    return _fresh_run_folder(EXPORT_PREFIX, parent, stale_after_s)


def fresh_upload_folder(parent: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> Path:
    """Gradio's upload cache for this run (app.py sets it as GRADIO_TEMP_DIR before Gradio is imported), with
    the export folder's lifetime: Gradio removes the files it made on a clean shutdown only, so uploads of a
    killed run stayed for ever in the shared <tmp>/gradio; in a folder of its own, the next start removes them."""
    return _fresh_run_folder(UPLOAD_PREFIX, parent, stale_after_s)


def _fresh_run_folder(prefix: str, parent: Path | None, stale_after_s: float) -> Path:
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    now = time.time()
    for folder in parent.glob(f"{prefix}*"):
        try:
            stale = folder.is_dir() and not folder.is_symlink() and (
                not _owner_alive(folder.name[len(prefix):]) or now - _newest_change(folder) > stale_after_s)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _owner_alive(suffix: str) -> bool:
    """Whether the process named in a run folder's name ("<prefix><pid>-<random>") still runs; True when the
    name carries no id (an earlier version's: only its age tells)."""
    pid, dash, _ = suffix.partition("-")
    if not (dash and pid.isdigit()):
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no process id at all
        return True
    return True


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
