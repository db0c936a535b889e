"""Re-run issue 34's file, request and key rows at their full sizes against a real app process.

scripts/hostile_rerun.py re-runs the import, upload and restart rows; this one the rest that a client can send
over HTTP, with the same app launcher and measurements (RSS with the converter's workers every 0.2 s,
`GET /v1/models` timed every 0.25 s; tests/test_documents_hostile.py and tests/test_security.py assert the same
bounds at the sizes a test can afford). Rows, each sent to /v1/chat/completions as a `file` part:
- a 30 KB DOCX whose document.xml holds 20 MiB of empty `<w:p/>`;
- a PDF with one 50 MiB flate content stream; a one-page PDF with 19 MB of text;
- HTML of 80,000 whitespace-only text nodes; 14 MB of HTML with 1,000,000 nested `<span>`;
- PDFs whose page tree loops or nests 5,000 deep; a JSON body nested 100,000 deep;
then, without a key, a cross-site `text/plain` POST and a rebinding `Host`; then the app restarted with a key:
200 wrong passwords to /login and 200 wrong bearer keys to /v1 from one address, what the right key gets then
from that address, and what the restart left in the data and temp folders. Prints a markdown table.

usage: python scripts/hostile_files_rerun.py [--port 7944] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from hostile_rerun import Row, Run, Watch, leftovers, measured, print_rows, session_count  # noqa: E402
from test_documents import docx_bytes, pdf_bytes  # noqa: E402  the tests' own builders
from test_documents_hostile import _pdf, pdf_with_content  # noqa: E402

MiB = 2**20
KEY = "hostile-rerun-key"
MIME = {"docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        "pdf": "application/pdf", "html": "text/html"}


# ------------------------------------------------------------------------------------------- files
def hostile_files() -> dict[str, tuple[str, bytes]]:
    """Issue 34's files at its sizes: what the row says -> (file name, bytes)."""
    line = b"(lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore) Tj T*\n"
    text = b"BT /F1 1 Tf 1 TL 0 790 Td\n" + line * (19_000_000 // len(line)) + b"ET"  # 1-point lines down the page
    looping = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Pages /Parent 2 0 R /Kids [2 0 R] /Count 1 >>"]
    deep = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    deep += [b"<< /Type /Pages /Kids [%d 0 R] /Count 1 >>" % (level + 3) for level in range(5_000)]
    deep.append(b"<< /Type /Page /MediaBox [0 0 10 10] >>")
    return {
        "DOCX with 20 MiB of empty <w:p/>": ("empty.docx", docx_bytes("<w:p/>" * 3_500_000, pages=None)),
        "PDF with one 50 MiB flate content stream": ("inflating.pdf", pdf_with_content(b" " * (50 * MiB))),
        "one-page PDF with 19 MB of text": ("wordy.pdf", pdf_with_content(text)),
        "HTML with 80,000 whitespace-only text nodes": (
            "spaces.html", b"<html><body><p>start</p>" + b"<i> </i>\n" * 80_000 + b"<p>end</p></body></html>"),
        "HTML of 1,000,000 nested <span>": (
            "nested.html", b"<html><body>" + b"<span>" * 1_000_000 + b"deep" + b"</span>" * 1_000_000 + b"</body></html>"),
        "PDF whose page tree loops": ("loop.pdf", _pdf(looping)),
        "PDF whose page tree nests 5,000 deep": ("deep.pdf", _pdf(deep)),
        "a plain one-page PDF (control)": ("plain.pdf", pdf_bytes([["The harbour opens at dawn."]])),
    }


def file_request(name: str, data: bytes) -> bytes:
    mime = MIME[name.rsplit(".", 1)[1]]
    part = {"type": "file", "file": {"filename": name,
                                     "file_data": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "Summarise it."}, part]}],
                       "max_tokens": 1}).encode()


# ------------------------------------------------------------------------------------------- requests
def call(run: Run, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(run.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def said(status: int, body: bytes) -> str:
    """The answer as the table says it: the status and, for a refusal, whether it is in OpenAI's shape."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return f"{status}, not JSON: {body[:80]!r}"
    if not isinstance(error, dict):
        return f"{status}"
    return f"{status} {error.get('type')}/{error.get('code')}: \"{str(error.get('message'))[:110]}\""


def file_rows(run: Run, watch: Watch, rows: list[Row]) -> None:
    json_api = {"content-type": "application/json"}
    for what, (name, data) in hostile_files().items():
        body = file_request(name, data)
        del data
        with measured(watch, rows, f"{what} ({len(body) * 3 / 4 / MiB:,.2f} MiB sent)") as row:
            before = session_count(run)
            status, _, answer = call(run, "POST", "v1/chat/completions", body, json_api)
            row.outcome = f"{said(status, answer)}; sessions {before} -> {session_count(run)}"
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with measured(watch, rows, "a JSON body nested 100,000 deep") as row:
        before = session_count(run)
        status, _, answer = call(run, "POST", "v1/chat/completions", deep, json_api)
        row.outcome = f"{said(status, answer)}; sessions {before} -> {session_count(run)}"


def cross_site_rows(run: Run, watch: Watch, rows: list[Row]) -> None:
    message = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    with measured(watch, rows, "no key: a text/plain POST to /v1/chat/completions from Origin evil.example") as row:
        before = session_count(run)
        status, _, answer = call(run, "POST", "v1/chat/completions", message,
                                 {"content-type": "text/plain", "origin": "http://evil.example"})
        row.outcome = f"{said(status, answer)}; sessions {before} -> {session_count(run)}"
    with measured(watch, rows, "Host and Origin evil.example on /v1/models and /config") as row:
        answers = []
        for path in ("v1/models", "config"):
            status, headers, answer = call(run, "GET", path, None, {"host": f"evil.example:{run.port}",
                                                                    "origin": f"http://evil.example:{run.port}"})
            cors = {k.lower(): v for k, v in headers.items()}.get("access-control-allow-origin", "none")
            answers.append(f"/{path}: {said(status, answer)}, Access-Control-Allow-Origin {cors}")
        row.outcome = "; ".join(answers)


def key_rows(run: Run, watch: Watch, rows: list[Row]) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    with measured(watch, rows, "200 wrong passwords to /login from one address") as row:
        statuses = [call(run, "POST", "login", b"username=me&password=wrong-%d" % n, form)[0] for n in range(200)]
        right = call(run, "POST", "login", f"username=me&password={KEY}".encode(), form)[0]
        row.outcome = f"{_counted(statuses)}; the right password then: {right}"
    json_api = {"content-type": "application/json"}
    with measured(watch, rows, "200 wrong bearer keys to /v1/models from one address") as row:
        answers = [call(run, "GET", "v1/models", None, {**json_api, "authorization": f"Bearer wrong-{n}"})
                   for n in range(200)]
        status, headers, body = call(run, "GET", "v1/models", None, {"authorization": f"Bearer {KEY}"})
        last = answers[-1]
        retry_after = {name.lower(): value for name, value in last[1].items()}.get("retry-after")
        row.outcome = (f"{_counted([a[0] for a in answers])}; the last: {said(last[0], last[2])}, Retry-After "
                       f"{retry_after}; the right key then: {status}")


def _counted(statuses: list[int]) -> str:
    counts: dict[int, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return ", ".join(f"{n} x {status}" for status, n in counts.items())


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=7944)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    os.environ.pop("GRADIO_TEMP_DIR", None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostile-files-"))
    print(f"load at start: {os.getloadavg()}; {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; workdir {workdir}", flush=True)
    rows: list[Row] = []
    run = Run(workdir, (), args.port)
    with run.serving():
        watch = Watch(run)
        file_rows(run, watch, rows)
        cross_site_rows(run, watch, rows)
        watch.close()
    key_file = workdir / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    keyed = Run(workdir, ("--api-key-file", str(key_file)), args.port)
    with keyed.serving() as app:
        watch = Watch(keyed)
        with measured(watch, rows, f"after the restart, with a key (pid {app.process.pid})") as row:
            row.outcome = json.dumps(leftovers(keyed))
        key_rows(keyed, watch, rows)
        watch.close()
    print_rows(rows)


if __name__ == "__main__":
    main()
