"""What one request may make the server hold: an upload's size (refused by the guard before it is read, cut
off when it sends more than it said), a JSON body's nesting (a 400 rather than a RecursionError)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ui.guard import PageGuard
from ui.request_limits import MAX_JSON_DEPTH, JsonTooDeep, check_json_nesting

received: list[int] = []


async def _upload(request):
    body = b""
    async for chunk in request.stream():
        body += chunk
    received.append(len(body))
    return JSONResponse({"bytes": len(body)})


def _client(most: int) -> TestClient:
    app = Starlette(routes=[Route("/gradio_api/upload", _upload, methods=["POST"])],
                    middleware=[Middleware(PageGuard, max_upload_bytes=most)])
    return TestClient(app, base_url="http://127.0.0.1:7860", raise_server_exceptions=False)


def test_an_upload_over_the_cap_is_refused_by_its_declared_length_before_it_is_read():
    received.clear()
    client = _client(most=1_000)
    answer = client.post("/gradio_api/upload", content=b"x" * 5_000)
    assert answer.status_code == 413
    assert answer.json()["error"]["message"].startswith("The upload is 5,000 bytes; this app takes at most 1,000 bytes")
    assert received == []
    assert client.post("/gradio_api/upload", content=b"x" * 1_000).json() == {"bytes": 1_000}


def test_an_upload_without_a_length_is_cut_off_at_the_cap():
    received.clear()
    client = _client(most=10_000)

    def chunks():
        for _ in range(100):
            yield b"y" * 1_000  # sent chunked: no Content-Length to refuse it by

    answer = client.post("/gradio_api/upload", content=chunks())
    assert answer.status_code != 200 and received == []  # the app stopped reading at the cap, storing nothing


def test_json_nested_past_the_bound_is_a_value_error_before_parsing():
    with pytest.raises(JsonTooDeep, match="nest 100,000 deep|nest 100000 deep"):
        check_json_nesting(b"[" * 100_000 + b"]" * 100_000)
    assert isinstance(JsonTooDeep("x"), ValueError)  # json_body's `except ValueError` makes it a 400
    ordinary = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "[[[{{{" * 500}]}],
                           "tools": [{"function": {"parameters": {"properties": {"a": {"items": [1]}}}}}]}).encode()
    assert check_json_nesting(ordinary) is ordinary  # brackets inside strings do not count
    escaped = json.dumps({"text": 'a quote \\" and then [[[[' * 200}).encode()
    assert check_json_nesting(escaped) is escaped
    at_bound = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert check_json_nesting(at_bound) is at_bound
    with pytest.raises(JsonTooDeep):
        check_json_nesting(b"[" + at_bound + b"]")


def _trickling_request(first: bytes, declared: int):
    """A Starlette request whose client sends `first`, then nothing more (the connection stays open)."""
    from starlette.requests import Request

    sent = []

    async def receive():
        if not sent:
            sent.append(first)
            return {"type": "http.request", "body": first, "more_body": True}
        await asyncio.sleep(3600)  # a slow sender: the next bytes never come

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(declared).encode())]}
    return Request(scope, receive)


def test_a_slow_sender_is_cut_off_with_a_408_in_openai_shape():
    from ui.api.protocol import ApiError
    from ui.api.serving import read_body

    request = _trickling_request(b'{"model": "x", "messages": [', declared=1000)
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(request, deadline_s=0.2))
    assert refused.value.status == 408
    body = refused.value.body()["error"]
    assert body["code"] == "request_timeout" and "28 bytes came" in body["message"]


def test_a_body_sent_at_once_is_read_whole_within_the_deadline():
    from starlette.requests import Request

    from ui.api.serving import read_body

    parts = [b'{"a": ', b'1}', b'']

    async def receive():
        body = parts.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(parts)}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": []}
    assert asyncio.run(read_body(Request(scope, receive), deadline_s=5)) == b'{"a": 1}'
