"""A deadline on each request's head: a client that trickles its request line and headers is cut off; and a
cap on the connections one client address may hold open (ui/client_slots.py).

uvicorn closes a connection left idle after a response (`timeout_keep_alive`), but one that has sent part of
a request head is waited on for ever: each byte cancels the idle timer, and nothing else runs before the
head is complete (the ASGI app, our guard included, sees a request only then). A slowloris client holds
hundreds of such connections at a byte a second. This protocol is uvicorn's h11 one with a timer that starts
whenever the connection waits for a request head (on connect, after each response) and is not reset by data:
a head not complete within HEAD_DEADLINE_S gets a 408 and the connection is closed.

    use_head_deadline()          # before demo.launch(): Gradio's server asks uvicorn for its "auto" protocol

The same protocol counts each client address's open connections before reading a byte: past
MAX_CONNECTIONS_PER_CLIENT a connection gets a plain 429 and is closed, so idle or trickling connections from
one address cannot spend the process's open files (each lasts at most HEAD_DEADLINE_S, but a client opens
new ones faster). A connection upgraded to a WebSocket stays counted until it closes: where a WebSocket package
is installed (`websockets` or `wsproto`, as with `uvicorn[standard]`), uvicorn hands the transport to its
WebSocket protocol, which alone hears of the close, so the count is handed over with it. Without one, uvicorn
answers an upgrade request as plain HTTP and the connection never leaves this protocol.

"auto" then means h11 even where httptools is installed (`uvicorn[standard]`; not in requirements.txt).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.protocols.http.h11_impl import H11Protocol

from .client_slots import RETRY_AFTER_S, ConnectionCounter

# A browser or client sends its whole head in one packet; ten seconds leave room for a slow network
# (nginx waits 60 s, Apache 20-40 s; uvicorn drops an idle kept-alive connection after 5 s)
HEAD_DEADLINE_S = 10.0
_REASON = f"The request's headers did not all arrive within {HEAD_DEADLINE_S:.0f} s.\n".encode()
TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(_REASON), _REASON))
_CROWDED = b"This address has too many connections open to this app; close some, then retry.\n"
TOO_MANY_CONNECTIONS = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\n"
                        b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                        % (RETRY_AFTER_S, len(_CROWDED), _CROWDED))


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the head deadline described above."""

    _head_timer: asyncio.TimerHandle | None = None
    _counted_as: str | None = None  # the client address this connection is counted against
    client_connections = ConnectionCounter()  # of every server in this process (one per app)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        address = self.client[0] if self.client else "unknown"
        if not self.client_connections.admit(address):
            self.logger.info("refused a connection from %s: %d open already", address, self.client_connections.most)
            self.transport.write(TOO_MANY_CONNECTIONS)
            self.transport.close()
            return
        self._counted_as = address
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        if self._counted_as is not None:
            self.client_connections.close(self._counted_as)
            self._counted_as = None
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        super().handle_websocket_upgrade(event)  # the transport's protocol is now uvicorn's WebSocket one
        self._stop_watching()
        address, self._counted_as = self._counted_as, None
        if address is not None:
            _release_when_lost(self.transport.get_protocol(), self.client_connections, address)

    def handle_events(self) -> None:  # also where a response completes: uvicorn starts the next cycle here
        super().handle_events()
        self._watch_head()

    def _watch_head(self) -> None:
        """Run the timer exactly while the client owes a request head (h11's IDLE: nothing of the next request
        parsed yet, whatever part of it has come)."""
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._stop_watching()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_DEADLINE_S, self._head_too_slow)

    def _stop_watching(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.logger.info("closed a connection whose request head took over %.0f s", HEAD_DEADLINE_S)
        self.transport.write(TIMED_OUT)  # h11 sends no response before a request: written as bytes
        self.transport.close()


def _release_when_lost(protocol: asyncio.BaseProtocol, counter: ConnectionCounter, address: str) -> None:
    """Make the protocol a counted connection was handed to give its count back when the connection is lost."""
    lost = protocol.connection_lost

    def connection_lost(exc: Exception | None) -> None:
        try:
            lost(exc)
        finally:
            counter.close(address)

    setattr(protocol, "connection_lost", connection_lost)  # on this one object: the transport calls it there


def use_head_deadline() -> None:
    """Make HeadDeadlineProtocol the protocol uvicorn's default ("auto") resolves to, for servers configured
    after this call: Gradio's launch() builds its uvicorn.Config without naming one."""
    HTTP_PROTOCOLS["auto"] = f"{__name__}:{HeadDeadlineProtocol.__name__}"
