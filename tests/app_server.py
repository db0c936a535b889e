"""Start `python app.py` in a real subprocess on a free port with a throw-away data dir (for the app tests).

usage (in a test module):
    from app_server import running_app
    @pytest.fixture(scope="module")
    def app(tmp_path_factory):
        with running_app(tmp_path_factory.mktemp("app-data")) as app:
            yield app      # app.url, app.data_dir, app.process, app.auth
    Client(app.url, auth=app.auth)   # app.auth: the page's login when the app has a key, else None
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gradio_client import Client

from ui.key_file import read_key_file

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunningApp:
    url: str
    data_dir: Path
    process: subprocess.Popen
    auth: tuple[str, str] | None = None  # (any user name, the key) when the app was given a key


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def page_served(url: str) -> bool:
    """Whether the page answers (it comes up at once; the model loads behind it)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _ready(url: str, auth: tuple[str, str] | None) -> bool:
    try:
        status = Client(url, verbose=False, auth=auth).predict(api_name="/status")
    except Exception:  # the server is not listening yet
        return False
    if status["error"]:
        raise RuntimeError(status["error"])
    return bool(status["ready"])


def _key_given(args: tuple[str, ...], environment: dict[str, str]) -> str | None:
    """The key the app will take from these flags or this environment (as ui/cli.py reads it)."""
    if "--api-key" in args:
        return args[args.index("--api-key") + 1]
    if "--api-key-file" in args:
        return read_key_file(Path(args[args.index("--api-key-file") + 1]), "--api-key-file")
    return environment.get("INFINIGEN_API_KEY")


@contextlib.contextmanager
def running_app(data_dir: Path, timeout_s: float = 600, args: tuple[str, ...] = (),
                env: dict[str, str] | None = None, until_ready: bool = True,
                compiled: bool = False, port: int | None = None) -> Iterator[RunningApp]:
    """The first run on a machine downloads and converts the model, hence the generous timeout. `args` are
    more flags for app.py, `env` more environment variables; `until_ready=False` hands the app over as soon
    as its page answers, while the model still loads. The app decodes eager (`--no-compile`) unless
    `compiled`: compiling costs every start 20-60 s on 2 cores, and the compiled step has its own tests
    (test_compiled.py on the shared real engine; test_browser_startup.py runs the app as it ships). `port`:
    a free one unless given. The app is stopped when the block ends, unless it was stopped (or killed) in it."""
    if not compiled:
        args = ("--no-compile", *args)
    port = port or free_port()
    environment = {**os.environ, **(env or {})}
    key = _key_given(args, environment)
    auth = ("tester", key) if key else None
    log_path = data_dir / "app.log"
    with open(log_path, "a") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--data-dir", str(data_dir), *args],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environment)
        url = f"http://127.0.0.1:{port}/"
        try:
            deadline = time.time() + timeout_s
            while not (_ready(url, auth) if until_ready else page_served(url)):
                if process.poll() is not None:
                    raise RuntimeError(f"app.py exited: {log_path.read_text()[-2000:]}")
                if time.time() > deadline:
                    raise RuntimeError(f"app.py was not ready after {timeout_s} s: {log_path.read_text()[-2000:]}")
                time.sleep(1)
            yield RunningApp(url, data_dir, process, auth)
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def log_in(page, app: RunningApp) -> None:
    """In a Playwright page that opened `app.url`: fill Gradio's login form when the app has a key (the page
    shows no chat until then); nothing to do without one."""
    if app.auth is None:
        return
    page.wait_for_selector("input[type='password']", timeout=60_000)
    page.locator("input[type='text']").first.fill(app.auth[0])
    page.locator("input[type='password']").fill(app.auth[1])
    page.locator("button:has-text('Login')").click()


CHROMIUM = "/usr/bin/chromium"  # Debian's package: Playwright's own browser download fails here


@contextlib.contextmanager
def chromium_page(url: str, width: int = 1400, height: int = 1300, init_script: str | None = None) -> Iterator:
    """A headless Chromium page at `url` (skips the test where Debian's chromium is missing); `init_script`
    runs in it before any of the page's own scripts."""
    import pytest

    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (apt-get install chromium)")
    args = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            if init_script is not None:
                page.add_init_script(init_script)
            page.goto(url)
            yield page
        finally:
            browser.close()
