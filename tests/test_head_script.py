"""HeadScript on a small Starlette app: the script lands right after <head> of an HTML page, whole or streamed
in parts, with a content-length that matches; anything else passes through byte for byte."""

from __future__ import annotations

import gzip

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ui.head_script import PAGE_SCRIPT, HeadScript, with_script

PAGE = '<!doctype html>\n<html lang="en">\n\t<head>\n\t\t<meta charset="utf-8" />\n\t</head>\n<body>hi</body></html>'
TAG = f"<script>{PAGE_SCRIPT}</script>"


def _client() -> TestClient:
    async def page(request):
        return Response(PAGE, media_type="text/html")

    async def parts(request):
        async def chunks():
            for piece in ("<!doctype html><html><he", "ad data-x='1'><title>t</title></head>", "<body>x</body></html>"):
                yield piece.encode()
        return StreamingResponse(chunks(), media_type="text/html; charset=utf-8")

    async def data(request):
        return JSONResponse({"html": "<head>"})

    async def packed(request):
        return Response(gzip.compress(PAGE.encode()), media_type="text/html", headers={"content-encoding": "gzip"})

    async def fragment(request):
        return Response("<p>no head here</p>", media_type="text/html")

    routes = [Route("/", page), Route("/parts", parts), Route("/data", data), Route("/packed", packed),
              Route("/fragment", fragment)]
    return TestClient(Starlette(routes=routes, middleware=[Middleware(HeadScript)]))


def test_the_script_comes_right_after_head_with_a_matching_length():
    response = _client().get("/")
    assert response.status_code == 200
    before, after = PAGE.split("<head>")
    assert response.text == before + "<head>" + TAG + after
    assert int(response.headers["content-length"]) == len(response.content)
    assert response.text.index(TAG) < response.text.index("<meta")


def test_a_page_streamed_in_parts_gets_it_once_after_a_head_with_attributes():
    response = _client().get("/parts")
    assert response.text == f"<!doctype html><html><head data-x='1'>{TAG}<title>t</title></head><body>x</body></html>"
    assert response.text.count("<script>") == 1


def test_json_compressed_html_and_html_without_a_head_pass_through_unchanged():
    client = _client()
    assert client.get("/data").json() == {"html": "<head>"}
    packed = client.get("/packed")  # the client inflates it: the original page, no script
    assert packed.text == PAGE
    fragment = client.get("/fragment")
    assert fragment.text == "<p>no head here</p>"
    assert int(fragment.headers["content-length"]) == len(fragment.content)


def test_with_script_places_the_tag_after_the_first_head_only():
    html = b"<html><HEAD>a</HEAD><body><head>b</head></body></html>"
    assert with_script(html, b"<s/>") == b"<html><HEAD><s/>a</HEAD><body><head>b</head></body></html>"
    assert with_script(b"<header>x</header>", b"<s/>") == b"<header>x</header>"  # <header> is not <head>
