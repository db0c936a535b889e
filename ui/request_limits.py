"""Bounds on what one request may make the server hold: an upload's size, a JSON body's nesting.

    demo.launch(max_file_size=MAX_UPLOAD_BYTES, ...)     # Gradio's own check on each uploaded file
    gr.Blocks(delete_cache=UPLOAD_CACHE_CLEANUP)          # Gradio removes old uploads, and all at a clean exit
    json.loads(check_json_nesting(body))                  # a 400, not a RecursionError

PageGuard enforces the upload size itself too (before Gradio reads the body), so the bound holds even where
launch() does not pass it.
"""

from __future__ import annotations

import array
import itertools

# A session export of a full window of the largest model this app runs (ImportLimits.total_bytes) or a 20 MiB
# attachment; a form's multipart framing adds a few hundred bytes.
MAX_UPLOAD_BYTES = 1 * 2**30 + 2**20
UPLOAD_PATHS = ("/gradio_api/upload", "/upload")
# (every `frequency` s, files older than `age` s): an upload is read within seconds of arriving
UPLOAD_CACHE_CLEANUP = (600, 3600)
# OpenAI's request bodies nest a handful of levels (a tool's JSON schema a few more); Python's parser
# recurses once per level and fails with RecursionError near 1,000
MAX_JSON_DEPTH = 100
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class JsonTooDeep(ValueError):
    """A JSON text nested deeper than the server parses; a ValueError as json.loads's own errors are."""


def check_json_nesting(body: bytes, most: int = MAX_JSON_DEPTH) -> bytes:
    """`body`, once its arrays and objects are seen to nest at most `most` deep (brackets inside strings do not
    count). Linear, and cheap where the body is mostly text: only its brackets are walked, at C speed."""
    if body.count(b"[") + body.count(b"{") <= most:
        return body
    steps = array.array("b", _brackets_outside_strings(body).translate(_DEPTH_STEP))  # +1 / -1 each
    deepest = max(itertools.accumulate(steps), default=0)
    if deepest > most:
        raise JsonTooDeep(f"arrays and objects nest {deepest} deep; at most {most} are accepted")
    return body


def _brackets_outside_strings(body: bytes) -> bytes:
    """The body's brackets in order, those inside JSON strings left out."""
    kept, in_string, start = bytearray(), False, 0
    while True:
        quote = body.find(b'"', start)
        segment = body[start:] if quote < 0 else body[start:quote]
        if not in_string:
            kept += segment.translate(None, _NOT_BRACKETS)
        if quote < 0:
            return bytes(kept)
        if in_string:  # the quote ends the string unless an odd run of backslashes escapes it
            in_string = (len(segment) - len(segment.rstrip(b"\\"))) % 2 == 1
        else:
            in_string = True
        start = quote + 1


def upload_refusal(scope, most: int = MAX_UPLOAD_BYTES) -> str | None:
    """Why an upload request is refused before its body is read (its declared length), or None."""
    if scope.get("method") != "POST" or scope.get("path", "").rstrip("/") not in UPLOAD_PATHS:
        return None
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.strip().isdigit() and int(value) > most:
            return (f"The upload is {int(value):,} bytes; this app takes at most {most:,} bytes "
                    f"({most / 2**20:,.0f} MiB) in one upload.")
    return None


def receive_at_most(receive, most: int):
    """An ASGI `receive` that reports the client gone once more than `most` body bytes have come (a sender
    that declared no length, or a wrong one): the app stops reading and nothing past the bound is held."""
    received = 0

    async def bounded():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > most:
                return {"type": "http.disconnect"}
        return message

    return bounded
