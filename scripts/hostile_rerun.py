"""Re-run issue 34's import and upload rows against a real app process, and check what a restart leaves.

A fresh `python app.py` on PORT with a throw-away data directory, its own TMPDIR and Gradio temp folder; the
app's RSS (with its children: the converter's worker processes) sampled every 0.2 s and `GET /v1/models`
timed every 0.25 s throughout. Rows:
- a truthful session file that reaches beyond the model's window (its chunks really hold every token's int8
  KV; the values are random, which nothing on import can tell): refused from its manifest;
- a truthful session file near the window's size: imported and opened, then shrunk to one short turn
  (`/edit_last`), to see the memory come back;
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
import subprocess
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

MiB = 2**20


# ------------------------------------------------------------------------------------------- the app
@dataclass
class App:
    port: int
    workdir: Path
    flags: list[str]
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def tmp(self) -> Path:
        return self.workdir / "tmp"

    def start(self, timeout_s: float = 900) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = {key: value for key, value in os.environ.items() if key != "GRADIO_TEMP_DIR"}
        env["TMPDIR"] = str(self.tmp)  # where the app keeps its export and upload folders
        log = open(self.workdir / "app.log", "a")  # noqa: SIM115  kept open for the process's life
        self.process = subprocess.Popen([sys.executable, "app.py", "--port", str(self.port), "--data-dir",
                                         str(self.data_dir), *self.flags], cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout_s
        while self.models_status() != 200:
            if self.process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"app.py did not come up: {(self.workdir / 'app.log').read_text()[-2000:]}")
            time.sleep(1)

    def models_status(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "v1/models", timeout=30) as response:
                return response.status
        except OSError as error:
            return getattr(error, "code", 0)

    def rss(self) -> int:
        """The app's resident memory with its children's (the converter's workers); 0 when it is not running."""
        if self.process is None:
            return 0
        try:
            parent = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.Error:
            return 0

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if kill:
            self.process.send_signal(signal.SIGKILL)
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


class Watch:
    """RSS every 0.2 s and /v1/models latency every 0.25 s, in the background, for as long as it runs."""

    def __init__(self, app: App) -> None:
        self.app, self.rss, self.latency, self._stop = app, [], [], threading.Event()
        self._threads = [threading.Thread(target=self._sample_rss, daemon=True),
                         threading.Thread(target=self._time_models, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _sample_rss(self) -> None:
        while not self._stop.wait(0.2):
            self.rss.append((time.monotonic(), self.app.rss()))

    def _time_models(self) -> None:
        while not self._stop.wait(0.25):
            started = time.monotonic()
            status = self.app.models_status()
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
    idle = [rss for _, rss in watch.rss[-5:]] or [watch.app.rss()]
    started = time.monotonic()
    try:
        yield row
    finally:
        time.sleep(1.0)  # what the app keeps once it is done
        row.seconds = time.monotonic() - started - 1.0
        during = [rss for at, rss in watch.rss if at >= started and rss] or [watch.app.rss()]
        row.idle_mib = statistics.median(idle) / MiB
        row.peak_mib = max(during) / MiB - row.idle_mib
        row.after_mib = during[-1] / MiB - row.idle_mib
        times = [seconds for at, seconds, _ in watch.latency if at >= started]
        row.slowest_models_ms = max(times, default=0.0) * 1000
        rows.append(row)
        print(f"{row.what}: {row.outcome} ({row.seconds:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------- session files
def seed_signature(app: App) -> dict[str, str]:
    """The loaded model's KV signature, from a one-token API turn's chunk (read from the app's database)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(app.url + "v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()
    with contextlib.closing(sqlite3.connect(f"file:{app.data_dir / 'sessions.db'}?mode=ro", uri=True)) as db:
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


def gradio_client(app: App):
    from gradio_client import Client

    return Client(app.url, verbose=False)


def session_count(app: App) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{app.data_dir / 'sessions.db'}?mode=ro", uri=True)) as db:
        return db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def leftovers(app: App) -> dict[str, list[str]]:
    """Import staging in the data directory; export and upload folders (with their files) in the app's TMPDIR."""
    def with_files(folder: Path) -> str:
        return f"{folder.name} ({sum(1 for p in folder.rglob('*') if p.is_file())} files)"

    return {"staging": sorted(p.name for p in app.data_dir.glob(".import-*")),
            "exports": sorted(with_files(p) for p in app.tmp.glob("infinigen-export-*")),
            "uploads": sorted(with_files(p) for p in app.tmp.glob("infinigen-uploads-*"))}


# ------------------------------------------------------------------------------------------- rows
def import_rows(app: App, watch: Watch, rows: list[Row], files: dict[str, Path]) -> None:
    from gradio_client import handle_file

    client = gradio_client(app)
    before = session_count(app)
    with measured(watch, rows, f"import beyond the window ({files['beyond'].stat().st_size / MiB:.0f} MiB)") as row:
        try:
            client.predict(handle_file(str(files["beyond"])), api_name="/import")
            row.outcome = "accepted?"
        except Exception as error:  # noqa: BLE001  the page's refusal comes back as the client's error
            row.outcome = f"refused: {str(error)[:160]}"
        row.outcome += f"; sessions {before} -> {session_count(app)}; staging {leftovers(app)['staging']}"
    with measured(watch, rows, f"import near the window ({files['near'].stat().st_size / MiB:.0f} MiB), "
                               "opened") as row:
        client.predict(handle_file(str(files["near"])), api_name="/import")
        row.outcome = f"imported; sessions {before} -> {session_count(app)}"
    with measured(watch, rows, "that session shrunk to one short turn (/edit_last)") as row:
        client.predict("Hi.", api_name="/edit_last")
        time.sleep(2)
        row.outcome = "shrunk"


def upload_rows(app: App, watch: Watch, rows: list[Row]) -> None:
    with measured(watch, rows, "300 MiB upload to /gradio_api/upload (no key)") as row:
        row.outcome = multipart_upload(app, 300 * MiB)
        row.outcome += f"; upload folder {folder_bytes(app.tmp) / MiB:.0f} MiB"
    with measured(watch, rows, "upload declaring 1.5 GiB (over the cap)") as row:
        connection = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
        connection.putrequest("POST", "/gradio_api/upload")
        connection.putheader("content-type", "multipart/form-data; boundary=x")
        connection.putheader("content-length", str(3 * 2**29))
        connection.endheaders()
        answer = connection.getresponse()
        row.outcome = f"{answer.status} {answer.read()[:100]!r}"


def multipart_upload(app: App, size: int) -> str:
    boundary = "hostile-rerun"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"big.bin\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    connection = http.client.HTTPConnection("127.0.0.1", app.port, timeout=600)
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


def kill_mid_import(app: App, watch: Watch, rows: list[Row], near: Path) -> None:
    from gradio_client import handle_file

    with measured(watch, rows, "kill -9 during an import") as row:
        client = gradio_client(app)
        threading.Thread(target=lambda: _quietly(client.predict, handle_file(str(near)), api_name="/import"),
                         daemon=True).start()
        deadline = time.monotonic() + 120
        while not list(app.data_dir.glob(".import-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen, pid = leftovers(app), app.process.pid
        app.stop(kill=True)
        row.outcome = f"killed (pid {pid}) with staging {seen['staging']}, uploads {seen['uploads']}"


def _quietly(call, *args, **kwargs) -> None:
    with contextlib.suppress(Exception):
        call(*args, **kwargs)


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=7942)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("app_flags", nargs="*", help="more app.py flags (after --)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostile-rerun-"))
    app = App(args.port, workdir, list(args.app_flags))
    print(f"load at start: {os.getloadavg()}; {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; workdir {workdir}", flush=True)
    rows: list[Row] = []
    app.start()
    try:
        watch = Watch(app)
        signature = seed_signature(app)
        files = {"beyond": truthful_session_file(signature, 12_000, workdir / "files"),
                 "near": truthful_session_file(signature, 8_000, workdir / "files")}
        import_rows(app, watch, rows, files)
        upload_rows(app, watch, rows)
        kill_mid_import(app, watch, rows, files["near"])
        watch.close()
        app.start()
        watch = Watch(app)
        with measured(watch, rows, f"after the restart (pid {app.process.pid})") as row:
            row.outcome = json.dumps(leftovers(app))
        watch.close()
    finally:
        app.stop()
    print(f"\nload at the end: {os.getloadavg()}\n")
    print("| row | outcome | s | idle RSS MiB | peak above idle MiB | kept above idle MiB | slowest /v1/models ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.what} | {row.outcome} | {row.seconds:.1f} | {row.idle_mib:.0f} | {row.peak_mib:+.0f} | "
              f"{row.after_mib:+.0f} | {row.slowest_models_ms:.0f} |")


if __name__ == "__main__":
    main()
