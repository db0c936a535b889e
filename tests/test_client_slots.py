"""One client cannot hold all of the server: a cap on its requests in flight (429 in OpenAI's shape, applied by
PageGuard) and on its open connections (the server's protocol), while another client still gets through.

A real uvicorn server in a thread, with the app's protocol and guard around a small app whose chat route
streams until the test lets it end; the second client is another loopback address (127.0.0.2).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocketDisconnect

from ui import slow_senders
from ui.client_slots import ClientSlots, ConnectionCounter, holds_server_resources
from ui.guard import PageGuard
from ui.slow_senders import HeadDeadlineProtocol

from app_server import free_port

MOST = 3
reached: list[str] = []
release = threading.Event()


async def _chat(request):
    reached.append(request.client.host)
    if request.query_params.get("hold") != "1":
        return JSONResponse({"object": "chat.completion"})

    async def tokens():
        yield b"data: {}\n\n"  # the headers and a first chunk go out: the stream is open
        while not release.is_set():
            await asyncio.sleep(0.02)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(tokens(), media_type="text/event-stream")


async def _models(request):
    return JSONResponse({"object": "list", "data": []})


async def _echo(websocket):
    await websocket.accept()
    try:
        while True:
            await websocket.send_text(await websocket.receive_text())
    except WebSocketDisconnect:
        pass


def serve(key: str | None, ws: str = "auto") -> Iterator[tuple[int, ClientSlots]]:
    slots = ClientSlots(most=MOST)
    routes = [Route("/v1/chat/completions", _chat, methods=["POST"]), Route("/v1/models", _models),
              WebSocketRoute("/echo", _echo)]
    app = Starlette(routes=routes, middleware=[Middleware(PageGuard, key=key, client_slots=slots)])
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=HeadDeadlineProtocol, ws=ws, log_level="warning",
                            lifespan="off")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    while not running.started:
        time.sleep(0.02)
    yield port, slots
    release.set()
    running.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, ClientSlots]]:
    yield from serve(key=None)


@pytest.fixture
def keyed_server() -> Iterator[tuple[int, ClientSlots]]:
    yield from serve(key="the-key")


def connect(port: int, source: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))


def post_chat(connection: http.client.HTTPConnection, hold: bool) -> http.client.HTTPResponse:
    connection.request("POST", f"/v1/chat/completions?hold={int(hold)}", body=b"{}",
                       headers={"Content-Type": "application/json"})
    return connection.getresponse()


def wait_until(condition, what: str, most_s: float = 10) -> None:
    """Wait for the server's side to catch up (a bound, not a timing: the test fails only if it never does)."""
    deadline = time.monotonic() + most_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_extra_request_of_one_client_gets_429_while_another_client_gets_through(server):
    port, slots = server
    release.clear()
    reached.clear()
    streams = [connect(port, "127.0.0.1") for _ in range(MOST)]
    for connection in streams:
        response = post_chat(connection, hold=True)
        assert response.status == 200 and response.read1(64).startswith(b"data:")  # streaming, holding its slot
    assert slots.held_by("127.0.0.1") == MOST

    extra = connect(port, "127.0.0.1")
    refused = post_chat(extra, hold=False)
    body = json.loads(refused.read())
    assert refused.status == 429 and refused.getheader("Retry-After") == "2"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    assert f"already has {MOST} requests in progress" in body["error"]["message"]
    assert reached == ["127.0.0.1"] * MOST  # the refused request never reached the app

    other = post_chat(connect(port, "127.0.0.2"), hold=False)
    assert other.status == 200 and json.loads(other.read()) == {"object": "chat.completion"}
    models = connect(port, "127.0.0.1")
    models.request("GET", "/v1/models")
    assert models.getresponse().status == 200  # a GET holds nothing and is not counted

    streams[0].close()  # the client goes away mid-stream: its slot comes back
    wait_until(lambda: slots.held_by("127.0.0.1") == MOST - 1, "a closed stream kept its slot")
    assert post_chat(connect(port, "127.0.0.1"), hold=False).status == 200
    release.set()  # the others' streams end: every slot comes back
    wait_until(lambda: slots.held_by("127.0.0.1") == 0, "an ended stream kept its slot")
    for connection in (*streams[1:], extra, models):
        connection.close()


def test_requests_without_the_key_hold_no_slot_so_they_cannot_lock_out_the_keyed_client(keyed_server):
    port, slots = keyed_server
    release.clear()
    reached.clear()
    senders = []
    for _ in range(MOST + 2):  # each would trickle its body for as long as the server waits for it
        sender = socket.create_connection(("127.0.0.1", port), timeout=10)
        sender.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                       b"\r\nContent-Length: 100000\r\n\r\n{")
        answer = b""  # refused at its head: the key is checked before a slot is taken
        while b"invalid_api_key" not in answer and (piece := sender.recv(4096)):
            answer += piece
        assert answer.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in answer
        senders.append(sender)
    assert slots.held_by("127.0.0.1") == 0 and reached == []
    keyed = connect(port, "127.0.0.1")
    keyed.request("POST", "/v1/chat/completions", body=b"{}",
                  headers={"Content-Type": "application/json", "Authorization": "Bearer the-key"})
    assert keyed.getresponse().status == 200 and reached == ["127.0.0.1"]
    wrong = connect(port, "127.0.0.1")
    wrong.request("POST", "/v1/chat/completions", body=b"{}",
                  headers={"Content-Type": "application/json", "Authorization": "Bearer not-the-key"})
    refused = wrong.getresponse()
    assert refused.status == 401 and json.loads(refused.read())["error"]["message"] == "incorrect API key"
    for connection in (*senders, keyed, wrong):
        connection.close()


def test_one_address_cannot_open_more_than_its_connections(server, monkeypatch):
    port, _ = server
    counter = ConnectionCounter(most=5)
    monkeypatch.setattr(HeadDeadlineProtocol, "client_connections", counter)
    monkeypatch.setattr(slow_senders, "HEAD_DEADLINE_S", 120.0)  # idle sockets are not closed on a slow machine
    idle = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0)) for _ in range(5)]
    wait_until(lambda: counter.open_from("127.0.0.3") == 5, "the idle connections were not counted")
    crowded = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.3", 0))
    answer = crowded.recv(4096)
    assert answer.startswith(b"HTTP/1.1 429 ") and b"too many connections" in answer
    assert crowded.recv(4096) == b""  # and closed
    assert counter.open_from("127.0.0.3") == 5  # the refused one was never counted

    fine = connect(port, "127.0.0.4")  # another address is served meanwhile
    fine.request("GET", "/v1/models")
    assert fine.getresponse().status == 200
    idle[0].close()
    wait_until(lambda: counter.open_from("127.0.0.3") == 4, "a closed connection stayed counted")
    again = connect(port, "127.0.0.3")
    again.request("GET", "/v1/models")
    assert again.getresponse().status == 200
    for connection in idle[1:]:
        connection.close()


# uvicorn's WebSocket implementations and the package each needs; without one installed, uvicorn answers an
# upgrade request as plain HTTP and the connection stays with the counting protocol
WEBSOCKET_IMPLEMENTATIONS = {"websockets-sansio": "websockets", "wsproto": "wsproto"}


def open_websocket(port: int, source: str, path: str = "/echo") -> tuple[socket.socket, bytes]:
    """A real WebSocket handshake from `source`; returns the socket and the server's answer head."""
    sender = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sender.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head and (piece := sender.recv(4096)):
        head += piece
    return sender, head


@pytest.mark.parametrize("implementation", sorted(WEBSOCKET_IMPLEMENTATIONS))
def test_a_connection_upgraded_to_a_websocket_stays_counted_until_it_closes(implementation, monkeypatch):
    """uvicorn hands an upgraded connection to its WebSocket protocol, and only that one hears of its close."""
    pytest.importorskip(WEBSOCKET_IMPLEMENTATIONS[implementation])
    counter = ConnectionCounter(most=3)
    monkeypatch.setattr(HeadDeadlineProtocol, "client_connections", counter)
    serving = serve(key=None, ws=implementation)
    port, _ = next(serving)
    try:
        sockets = []
        for _ in range(3):
            websocket, head = open_websocket(port, "127.0.0.5")
            assert head.startswith(b"HTTP/1.1 101 "), head
            sockets.append(websocket)
        wait_until(lambda: counter.open_from("127.0.0.5") == 3, "the WebSockets were not counted")
        crowded = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.5", 0))
        assert crowded.recv(4096).startswith(b"HTTP/1.1 429 ")  # open WebSockets hold their places
        crowded.close()
        for websocket in sockets:
            websocket.close()
        wait_until(lambda: counter.open_from("127.0.0.5") == 0, "closed WebSockets stayed counted")

        refused, head = open_websocket(port, "127.0.0.5", path="/no-such-socket")  # the app refuses the upgrade
        assert head.startswith(b"HTTP/1.1 403 "), head
        refused.close()
        wait_until(lambda: counter.open_from("127.0.0.5") == 0, "a refused upgrade stayed counted")
        for _ in range(3):  # every place is free again
            websocket, head = open_websocket(port, "127.0.0.5")
            assert head.startswith(b"HTTP/1.1 101 "), head
            websocket.close()
    finally:
        next(serving, None)


def test_what_is_counted_and_the_caps_settings():
    assert holds_server_resources("POST", "/v1/chat/completions") and holds_server_resources("POST", "/tokenize")
    assert holds_server_resources("POST", "/gradio_api/upload")
    assert not holds_server_resources("GET", "/v1/models")
    assert not holds_server_resources("POST", "/gradio_api/queue/join")  # the page's own routes: every tab holds some
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "client": ("10.0.0.9", 1)}
    unlimited = ClientSlots(most=0)
    assert not any(unlimited.claim(scope).refused for _ in range(50))
    one = ClientSlots(most=1)
    first = one.claim(scope)
    assert not first.refused and one.claim(scope).refused
    first.release()
    first.release()  # a second release frees nothing more
    assert one.held_by("10.0.0.9") == 0 and not one.claim(scope).refused
    with pytest.raises(ValueError):
        ClientSlots(most=-1)


def test_the_counters_forget_an_address_that_holds_nothing():
    """Both counters keep only the addresses in use: a client that came and went leaves no entry behind (one
    per address ever seen would grow for as long as the app runs)."""
    slots, connections = ClientSlots(most=2), ConnectionCounter(most=2)
    for n in range(50):
        address = f"10.1.0.{n}"
        held = [slots.claim({"type": "http", "method": "POST", "path": "/v1/completions", "client": (address, 1)})
                for _ in range(2)]
        assert connections.admit(address) and connections.admit(address) and not connections.admit(address)
        for slot in held:
            slot.release()
        connections.close(address)
        assert connections.open_from(address) == 1
        connections.close(address)
    assert slots._held == {} and connections._open == {}
