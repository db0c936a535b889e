"""Temporary folders a client can fill are removed after use and at start, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ui.temp_folders import EXPORT_PREFIX, UPLOAD_PREFIX, fresh_export_folder, fresh_upload_folder, remove_upload


def test_a_new_export_folder_removes_stale_ones_of_earlier_runs_only(tmp_path):
    stale = tmp_path / f"{EXPORT_PREFIX}old"
    stale.mkdir()
    (stale / "chat.igchat").write_bytes(b"x" * 1000)
    hour_ago = time.time() - 7200
    for path in (stale / "chat.igchat", stale):
        os.utime(path, (hour_ago, hour_ago))
    running = tmp_path / f"{EXPORT_PREFIX}running"  # another app's folder, exported to a minute ago
    running.mkdir()
    (running / "chat.igchat").write_bytes(b"y")
    unrelated = tmp_path / "someone-else-old"
    unrelated.mkdir()
    os.utime(unrelated, (hour_ago, hour_ago))
    folder = fresh_export_folder(tmp_path)
    assert folder.is_dir() and folder.name.startswith(EXPORT_PREFIX)
    assert not stale.exists() and running.is_dir() and unrelated.is_dir()


def test_an_export_folder_whose_app_is_gone_is_removed_at_once_and_a_live_ones_kept(tmp_path):
    """A run killed with kill -9 leaves its folder: the next start removes it, not an hour later."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{EXPORT_PREFIX}{int(ended.stdout)}-k1ll3d"
    dead.mkdir()
    (dead / "chat.igchat").write_bytes(b"x" * 1000)
    live = tmp_path / f"{EXPORT_PREFIX}{os.getppid()}-l1ve"  # the process that started this test runs
    live.mkdir()
    killed_uploads = tmp_path / f"{UPLOAD_PREFIX}{int(ended.stdout)}-k1ll3d"  # uploads of the same killed run
    (killed_uploads / "4f1c").mkdir(parents=True)
    (killed_uploads / "4f1c" / "big.bin").write_bytes(b"z" * 1000)
    folder = fresh_export_folder(tmp_path)
    assert folder.name.startswith(f"{EXPORT_PREFIX}{os.getpid()}-")
    assert not dead.exists() and live.is_dir() and killed_uploads.is_dir()  # each kind sweeps its own
    uploads = fresh_upload_folder(tmp_path)
    assert uploads.name.startswith(f"{UPLOAD_PREFIX}{os.getpid()}-") and not killed_uploads.exists()


def test_an_upload_is_removed_with_its_folder_but_nothing_outside_the_cache(tmp_path):
    cache = tmp_path / "gradio"
    upload = cache / "3f2a" / "chat.igchat"
    upload.parent.mkdir(parents=True)
    upload.write_bytes(b"z" * 100)
    mine = tmp_path / "notes.txt"
    mine.write_text("my own file")
    assert remove_upload(upload, cache) and not upload.parent.exists() and cache.is_dir()
    assert not remove_upload(mine, cache) and mine.read_text() == "my own file"
    assert not remove_upload(cache / ".." / "notes.txt", cache) and mine.exists()  # no way out of the cache
