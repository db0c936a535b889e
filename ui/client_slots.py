"""How much of the server one client address may hold at once, so that one client cannot take every place.

- Requests: at most `most` requests in flight per client address on the routes that hold the server's
  resources for as long as they last: POSTs to the API (a turn waits its place in the model's queue, a body
  of up to 32 MiB is read and its files converted) and to the page's upload route (up to 1 GiB streamed to
  disk); `GET /v1/models` holds nothing and is not counted. One
  more gets 429 in OpenAI's error shape (`ClientSlots`, applied by PageGuard); a request holds its slot from
  its head to its response's last byte (a stream's included). The page's own routes (its queue's event
  stream, heartbeats, assets) are not counted: every open tab holds some of them for as long as it is open.
- Connections: at most MAX_CONNECTIONS_PER_CLIENT open connections per client address, idle or not
  (`ConnectionCounter`, applied by ui/slow_senders.py's protocol before a byte is read): one more is answered
  a plain 429 and closed at once, so a client cannot spend the process's open files.

The address is the connection's own (ui/site_checks.ignore_forwarded_headers): every program on this machine
is the one client 127.0.0.1, and so is every visitor of a `--share` link (Gradio's tunnel connects locally).

    guard = PageGuard(app, client_slots=ClientSlots(most=4))
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from .request_limits import UPLOAD_PATHS
from .site_checks import is_api_path

DEFAULT_REQUESTS_PER_CLIENT = 4
# A browser opens 6 connections per host (all its tabs together) and the page keeps one or two; a hundred
# leave room for tabs, scripts and tools on one machine
MAX_CONNECTIONS_PER_CLIENT = 100
RETRY_AFTER_S = 2


def client_address(scope) -> str:
    return (scope.get("client") or ("unknown", 0))[0]


def holds_server_resources(method: str, path: str) -> bool:
    """Whether a request is counted against its client's slots: a POST (or other body-carrying method) to the
    API or the upload route. A GET there (`/v1/models`) holds nothing and is answered at once."""
    if method in ("GET", "HEAD", "OPTIONS"):
        return False
    return is_api_path(path) or path.rstrip("/") in UPLOAD_PATHS


def _count_one_less(counts: Counter[str], address: str) -> None:
    """One fewer for `address`; an address down to none is forgotten (the counters hold only addresses in use)."""
    counts[address] -= 1
    if counts[address] <= 0:
        del counts[address]


@dataclass
class Slot:
    """A request's place: `refused` when its client already holds every slot; `release` frees it (once)."""

    slots: ClientSlots | None
    address: str
    refused: bool = False

    def release(self) -> None:
        if self.slots is not None and not self.refused:
            self.slots._release(self.address)
            self.slots = None


class ClientSlots:
    """At most `most` counted requests in flight per client address (0: no cap)."""

    def __init__(self, most: int = DEFAULT_REQUESTS_PER_CLIENT) -> None:
        if most < 0:
            raise ValueError(f"requests per client must be 0 (no cap) or more, got {most}")
        self.most = most
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def claim(self, scope) -> Slot:
        """The request's slot: not counted (a page route, or no cap), held, or refused."""
        if (self.most == 0 or scope.get("type") != "http"
                or not holds_server_resources(scope.get("method", ""), scope.get("path", ""))):
            return Slot(None, "")
        address = client_address(scope)
        with self._lock:
            if self._held[address] >= self.most:
                return Slot(self, address, refused=True)
            self._held[address] += 1
        return Slot(self, address)

    def held_by(self, address: str) -> int:
        with self._lock:
            return self._held[address]

    def refusal(self) -> str:
        return (f"This client already has {self.most} requests in progress, the most one client may have at once "
                f"(--max-requests-per-client); wait for one to finish, then retry.")

    def _release(self, address: str) -> None:
        with self._lock:
            _count_one_less(self._held, address)


class ConnectionCounter:
    """Open connections per client address; `admit` says whether one more may be kept."""

    def __init__(self, most: int = MAX_CONNECTIONS_PER_CLIENT) -> None:
        self.most = most
        self._open: Counter[str] = Counter()

    def admit(self, address: str) -> bool:
        """Count a new connection from `address`, or refuse it (not counted) when it has `most` open already.
        Called on the event loop only, as `close` is."""
        if self._open[address] >= self.most:
            return False
        self._open[address] += 1
        return True

    def close(self, address: str) -> None:
        _count_one_less(self._open, address)

    def open_from(self, address: str) -> int:
        return self._open[address]
