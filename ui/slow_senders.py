"""A deadline on each request's head: a client that trickles its request line and headers is cut off.

uvicorn closes a connection left idle after a response (`timeout_keep_alive`), but one that has sent part of
a request head is waited on for ever: each byte cancels the idle timer, and nothing else runs before the
head is complete (the ASGI app, our guard included, sees a request only then). A slowloris client holds
hundreds of such connections at a byte a second. This protocol is uvicorn's h11 one with a timer that starts
whenever the connection waits for a request head (on connect, after each response) and is not reset by data:
a head not complete within HEAD_DEADLINE_S gets a 408 and the connection is closed.

    use_head_deadline()          # before demo.launch(): Gradio's server asks uvicorn for its "auto" protocol

"auto" then means h11 even where httptools is installed (`uvicorn[standard]`; not in requirements.txt).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.protocols.http.h11_impl import H11Protocol

# A browser or client sends its whole head in one packet; ten seconds leave room for a slow network
# (nginx waits 60 s, Apache 20-40 s; uvicorn drops an idle kept-alive connection after 5 s)
HEAD_DEADLINE_S = 10.0
_REASON = f"The request's headers did not all arrive within {HEAD_DEADLINE_S:.0f} s.\n".encode()
TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(_REASON), _REASON))


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the head deadline described above."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        super().connection_lost(exc)

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


def use_head_deadline() -> None:
    """Make HeadDeadlineProtocol the protocol uvicorn's default ("auto") resolves to, for servers configured
    after this call: Gradio's launch() builds its uvicorn.Config without naming one."""
    HTTP_PROTOCOLS["auto"] = f"{__name__}:{HeadDeadlineProtocol.__name__}"
