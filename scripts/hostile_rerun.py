"""Re-run issue 34's import and upload rows against a real app process, and check what a restart leaves.

A fresh `python app.py` (started by tests/app_server.running_app, as the app ships: compiled) on PORT with a
throw-away data directory and its own TMPDIR (where the app makes its export and upload folders); the
app's RSS (with its children: the converter's worker processes) sampled every 0.2 s and `GET /v1/models`
timed every 0.25 s throughout. Rows:
- truthful session files (their chunks really hold every token's int8 KV; the values are random, which
  nothing on import can tell) of 100,000 tokens (1.19 GB, issue 34's) and of 12,000, beyond the model's
  window: refused;
- a truthful session file near the window's size: imported and opened, then shrunk to one short turn
  (`/edit_last`), to see the memory come back (what stays above the app's idle before the import);
- a 300 MiB upload to the page's upload route, and one that declares more than the cap;
- kill -9 during an import, then a restart: no `.import-*` staging, no earlier `infinigen-export-*` folder
  and no earlier upload left.
Prints a markdown table (docs/HOSTILE.md keeps one).

usage: python scripts/hostile_rerun.py [--port 7942] [--workdir DIR] [-- app.py flags, e.g. --no-compile]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infinigen_core.rows import KEYS, POSITIONS, TOKEN_IDS, VALUES, tensor_name  # noqa: E402
from sessions import SessionStore  # noqa: E402
from sessions.snapshots import write_chunk  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from app_server import RunningApp, running_app  # noqa: E402  the tests' launcher, not a second copy

MiB = 2**20


# ------------------------------------------------------------------------------------------- the app
@dataclass
class Run:
    """Where a run keeps its app's data and temp folders, and the app now serving (tests/app_server.py's)."""

    workdir: Path
    flags: tuple[str, ...]
    port: int
    app: RunningApp | None = None

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def tmp(self) -> Path:
        return self.workdir / "tmp"

    @property
    def url(self) -> str:
        assert self.app is not None
        return self.app.url

    @contextlib.contextmanager
    def serving(self) -> Iterator[RunningApp]:
        """A fresh `python app.py` with this run's data and TMPDIR (its export and upload folders), as it
        ships (compiled), until the block ends or the app is killed in it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        with running_app(self.data_dir, timeout_s=900, args=self.flags, env={"TMPDIR": str(self.tmp)},
                         compiled=True, port=self.port) as app:
            self.app = app
            try:
                yield app
            finally:
                self.app = None

    def models_status(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "v1/models", timeout=30) as response:
                return response.status
        except OSError as error:
            return getattr(error, "code", 0)

    def rss(self) -> int:
        """The app's resident memory with its children's (the converter's workers); 0 when it is not running."""
        if self.app is None or self.app.process.poll() is not None:
            return 0
        try:
            parent = psutil.Process(self.app.process.pid)
            return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.Error:
            return 0

    def kill(self) -> int:
        """kill -9 the app (running_app's exit then finds it gone); its pid."""
        assert self.app is not None
        self.app.process.send_signal(signal.SIGKILL)
        self.app.process.wait()
        return self.app.process.pid


class Watch:
    """RSS every 0.2 s and /v1/models latency every 0.25 s, in the background, for as long as it runs."""

    def __init__(self, run: Run) -> None:
        self.run, self._stop = run, threading.Event()
        self.rss: list[tuple[float, int]] = []
        self.latency: list[tuple[float, float, int]] = []
        self._threads = [threading.Thread(target=self._sample_rss, daemon=True),
                         threading.Thread(target=self._time_models, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _sample_rss(self) -> None:
        while not self._stop.wait(0.2):
            self.rss.append((time.monotonic(), self.run.rss()))

    def _time_models(self) -> None:
        while not self._stop.wait(0.25):
            started = time.monotonic()
            status = self.run.models_status()
            self.latency.append((started, time.monotonic() - started, status))

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


@dataclass
class Row:
    what: str
    outcome: str = ""
    seconds: float = 0.0
    idle_mib: float = 0.0
    peak_mib: float = 0.0
    after_mib: float = 0.0
    slowest_models_ms: float = 0.0
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def measured(watch: Watch, rows: list[Row], what: str) -> Iterator[Row]:
    row = Row(what)
    time.sleep(1.0)
    idle = [rss for _, rss in watch.rss[-5:]] or [watch.run.rss()]
    started = time.monotonic()
    try:
        yield row
    finally:
        time.sleep(1.0)  # what the app keeps once it is done
        row.seconds = time.monotonic() - started - 1.0
        during = [rss for at, rss in watch.rss if at >= started and rss] or [watch.run.rss()]
        row.idle_mib = statistics.median(idle) / MiB
        row.peak_mib = max(during) / MiB - row.idle_mib
        row.after_mib = during[-1] / MiB - row.idle_mib
        times = [seconds for at, seconds, _ in watch.latency if at >= started]
        row.slowest_models_ms = max(times, default=0.0) * 1000
        rows.append(row)
        print(f"{row.what}: {row.outcome} ({row.seconds:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------- session files
def seed_signature(run: Run) -> dict[str, str]:
    """The loaded model's KV signature, from a one-token API turn's chunk (read from the app's database)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(run.url + "v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()
    with contextlib.closing(sqlite3.connect(f"file:{run.data_dir / 'sessions.db'}?mode=ro", uri=True)) as db:
        return json.loads(db.execute("SELECT signature FROM kv_signatures LIMIT 1").fetchone()[0])


def truthful_session_file(signature: dict[str, str], tokens: int, folder: Path) -> Path:
    """An .igchat of one user message of `tokens - 1` tokens and a one-token reply, whose chunks hold int8 KV
    for every token (random values), written and exported by the sessions package itself."""
    store = SessionStore(folder / f"build-{tokens}")
    session_id = store.create(f"{tokens} tokens")
    store.add_messages(session_id, [("user", "lorem ipsum " * (tokens // 3), 0, tokens - 1),
                                    ("assistant", "Yes.", tokens - 1, tokens)])
    layers, heads, dim = (int(signature[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    generator = torch.Generator().manual_seed(0)
    for start in range(0, tokens, 2048):
        end = min(start + 2048, tokens)
        rows = {TOKEN_IDS: torch.randint(0, 1000, (end - start,), generator=generator)}
        for layer in range(layers):
            for kind in (KEYS, VALUES):
                rows[tensor_name(kind, layer)] = torch.randn(heads, end - start, dim, generator=generator)
            rows[tensor_name(POSITIONS, layer)] = torch.arange(start, end)
        record = write_chunk(store.data_dir, session_id, rows, signature, start, "int8")
        store.add_chunk(session_id, record, signature, end)
    return store.export(session_id, folder / f"session-{tokens}.igchat")


def gradio_client(run: Run):
    from gradio_client import Client

    return Client(run.url, verbose=False)


def session_count(run: Run) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{run.data_dir / 'sessions.db'}?mode=ro", uri=True)) as db:
        return db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]


def session_tokens(run: Run, session_id: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{run.data_dir / 'sessions.db'}?mode=ro", uri=True)) as db:
        return db.execute("SELECT token_count FROM sessions WHERE id = ?", [session_id]).fetchone()[0]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def leftovers(run: Run) -> dict[str, list[str]]:
    """Import staging in the data directory; export and upload folders (with their files) in the app's TMPDIR."""
    def with_files(folder: Path) -> str:
        return f"{folder.name} ({sum(1 for p in folder.rglob('*') if p.is_file())} files)"

    return {"staging": sorted(p.name for p in run.data_dir.glob(".import-*")),
            "exports": sorted(with_files(p) for p in run.tmp.glob("infinigen-export-*")),
            "uploads": sorted(with_files(p) for p in run.tmp.glob("infinigen-uploads-*"))}


# ------------------------------------------------------------------------------------------- rows
def import_rows(run: Run, watch: Watch, rows: list[Row], files: dict[str, Path]) -> None:
    from gradio_client import handle_file

    client = gradio_client(run)
    before = session_count(run)
    for name, what in (("huge", "a truthful 100,000-token int8 import"), ("beyond", "import beyond the window")):
        with measured(watch, rows, f"{what} ({files[name].stat().st_size / MiB:,.0f} MiB)") as row:
            try:
                client.predict(handle_file(str(files[name])), api_name="/import")
                row.outcome = "accepted?"
            except Exception as error:  # noqa: BLE001  the page's refusal comes back as the client's error
                row.outcome = f"refused: {str(error)[:160]}"
            row.outcome += f"; sessions {before} -> {session_count(run)}; staging {leftovers(run)['staging']}"
    idle_before = run.rss()
    with measured(watch, rows, f"import near the window ({files['near'].stat().st_size / MiB:.0f} MiB), "
                               "opened") as row:
        client.predict(handle_file(str(files["near"])), api_name="/import")
        row.outcome = f"imported; sessions {before} -> {session_count(run)}"
    with measured(watch, rows, "that session shrunk to one short turn (/edit_last)") as row:
        client.predict("Hi.", api_name="/edit_last")
        time.sleep(2)
        tokens = session_tokens(run, client.predict(api_name="/status")["session"])
        row.outcome = (f"shrunk to {tokens} tokens; kept above the app's idle before the import: "
                       f"{(run.rss() - idle_before) / MiB:+.0f} MiB")


def upload_rows(run: Run, watch: Watch, rows: list[Row]) -> None:
    with measured(watch, rows, "300 MiB upload to /gradio_api/upload (no key)") as row:
        row.outcome = multipart_upload(run, 300 * MiB)
        uploads = sum(folder_bytes(folder) for folder in run.tmp.glob("infinigen-uploads-*"))
        row.outcome += f"; upload folders {uploads / MiB:.0f} MiB"  # TMPDIR also holds torch's compile cache
    with measured(watch, rows, "upload declaring 1.5 GiB (over the cap)") as row:
        connection = http.client.HTTPConnection("127.0.0.1", run.port, timeout=60)
        connection.putrequest("POST", "/gradio_api/upload")
        connection.putheader("content-type", "multipart/form-data; boundary=x")
        connection.putheader("content-length", str(3 * 2**29))
        connection.endheaders()
        answer = connection.getresponse()
        row.outcome = f"{answer.status} {answer.read()[:100]!r}"


def multipart_upload(run: Run, size: int) -> str:
    boundary = "hostile-rerun"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"big.bin\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    connection = http.client.HTTPConnection("127.0.0.1", run.port, timeout=600)
    connection.putrequest("POST", "/gradio_api/upload")
    connection.putheader("content-type", f"multipart/form-data; boundary={boundary}")
    connection.putheader("content-length", str(len(head) + size + len(tail)))
    connection.endheaders()
    piece = b"\0" * MiB
    try:
        connection.send(head)
        for _ in range(size // MiB):
            connection.send(piece)
        connection.send(tail)
    except OSError as error:
        return f"cut off while sending ({error})"
    answer = connection.getresponse()
    return f"{answer.status} {answer.read()[:80]!r}"


def kill_mid_import(run: Run, watch: Watch, rows: list[Row], near: Path) -> None:
    from gradio_client import handle_file

    with measured(watch, rows, "kill -9 during an import") as row:
        client = gradio_client(run)
        threading.Thread(target=lambda: _quietly(client.predict, handle_file(str(near)), api_name="/import"),
                         daemon=True).start()
        deadline = time.monotonic() + 120
        while not list(run.data_dir.glob(".import-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = leftovers(run)
        pid = run.kill()
        row.outcome = f"killed (pid {pid}) with staging {seen['staging']}, uploads {seen['uploads']}"


def _quietly(call, *args, **kwargs) -> None:
    with contextlib.suppress(Exception):
        call(*args, **kwargs)


# ------------------------------------------------------------------------------------------- main
def print_rows(rows) -> None:
    """The machine's load, then the rows as a markdown table (the reruns' report)."""
    print(f"\nload at the end: {os.getloadavg()}\n")
    print("| row | outcome | s | idle RSS MiB | peak above idle MiB | kept above idle MiB | slowest /v1/models ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.what} | {row.outcome} | {row.seconds:.1f} | {row.idle_mib:.0f} | {row.peak_mib:+.0f} | "
              f"{row.after_mib:+.0f} | {row.slowest_models_ms:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=7942)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("app_flags", nargs="*", help="more app.py flags (after --)")
    args = parser.parse_args()
    os.environ.pop("GRADIO_TEMP_DIR", None)  # the app makes its own upload folder under TMPDIR, as it ships
    run = Run(args.workdir or Path(tempfile.mkdtemp(prefix="hostile-rerun-")), tuple(args.app_flags), args.port)
    print(f"load at start: {os.getloadavg()}; {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; workdir {run.workdir}", flush=True)
    rows: list[Row] = []
    with run.serving():
        watch = Watch(run)
        signature = seed_signature(run)
        files = {name: truthful_session_file(signature, tokens, run.workdir / "files")
                 for name, tokens in (("huge", 100_000), ("beyond", 12_000), ("near", 8_000))}
        import_rows(run, watch, rows, files)
        upload_rows(run, watch, rows)
        kill_mid_import(run, watch, rows, files["near"])
        watch.close()
    with run.serving() as app:
        watch = Watch(run)
        with measured(watch, rows, f"after the restart (pid {app.process.pid})") as row:
            row.outcome = json.dumps(leftovers(run))
        watch.close()
    print_rows(rows)


if __name__ == "__main__":
    main()
