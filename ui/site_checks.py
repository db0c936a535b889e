"""What keeps other web sites from using the app through the user's own browser (PageGuard applies these).

A page on evil.example can make the browser send requests to http://127.0.0.1:7860: a form or a `text/plain`
fetch goes out without asking the server first, and its answer is hidden only by CORS. A DNS-rebinding page
goes further: its own name, evil.example, points at 127.0.0.1 after the page has loaded, so the browser
treats the app as evil.example itself and lets the page read every answer. Hence:

- the Host header must be a loopback name, an IP address (rebinding needs a name the attacker controls), the
  address the app listens on, or a name the app was given (`HostPolicy`);
- a request that can change something (any method but GET, HEAD, OPTIONS) or a WebSocket whose Origin is not
  the app's own (the same host and port the request was sent to) is refused; a request without an Origin comes
  from a program (curl, the OpenAI client), which the key guards where there is one;
- without a key, a POST to /v1 (or /tokenize) must be `application/json`, which a browser sends cross-site only
  after a CORS preflight that this app never grants;
- an `Access-Control-Allow-Origin` naming any origin but the app's own is removed from every answer;
- /login answers a few failed attempts a minute per client address (`LoginThrottle`), the address the
  connection comes from: `ignore_forwarded_headers()` keeps uvicorn from taking it from `X-Forwarded-For`.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from .failure_throttle import FailureThrottle

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOGIN_PATHS = frozenset({"/login", "/login/", "/gradio_api/login", "/gradio_api/login/"})
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
_ALL_INTERFACES = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


@dataclass(frozen=True)
class HostPolicy:
    """The Host names the app answers to besides loopback names and IP addresses. `any_host` turns the check off
    (for a tunnel such as Gradio's share link, whose name the app cannot know in advance)."""

    names: frozenset[str] = frozenset()
    any_host: bool = False

    @classmethod
    def listening_on(cls, host: str, *names: str, any_host: bool = False) -> HostPolicy:
        extra = {n.lower().rstrip(".") for n in names}
        if host not in _ALL_INTERFACES:
            extra.add(host.lower().strip("[]").rstrip("."))
        return cls(frozenset(extra), any_host)

    def allows(self, host_header: str) -> bool:
        if self.any_host:
            return True
        host = _host_name(host_header)
        if not host:
            return False
        if host in _LOOPBACK_NAMES or host.endswith(".localhost") or host in self.names:
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True


def _host_name(host_header: str) -> str:
    """'Example.COM:7860' -> 'example.com'; '[::1]:7860' -> '::1'."""
    try:
        return (urlsplit("//" + host_header.strip()).hostname or "").rstrip(".")
    except ValueError:
        return ""


def header(scope, name: bytes) -> str | None:
    """A request header's value (latin-1, as HTTP sends it), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def own_origin(scope) -> str | None:
    """The origin the request was sent to, as a browser on the app's page would write it."""
    host = header(scope, b"host")
    if not host:
        return None
    secure = scope.get("scheme") in ("https", "wss")
    return f"{'https' if secure else 'http'}://{host.strip().lower()}"


def _same_origin(origin: str, scope) -> bool:
    own = own_origin(scope)
    if own is None:
        return False
    try:
        theirs, ours = urlsplit(origin.strip().lower()), urlsplit(own)
        return (theirs.hostname, theirs.port or _default_port(theirs.scheme)) == \
            (ours.hostname, ours.port or _default_port(ours.scheme))
    except ValueError:
        return False


def _default_port(scheme: str) -> int:
    return 443 if scheme in ("https", "wss") else 80


def cross_site_refusal(scope, hosts: HostPolicy, json_only_api: bool = True) -> Refusal | None:
    """Why this request may not reach the app, or None. `json_only_api`: a POST to the API (/v1 and /tokenize
    beside it) must say JSON (the app asks it where there is no key; with one, a cross-site request lacks the
    key anyway)."""
    host = header(scope, b"host") or ""
    if not hosts.allows(host):
        return Refusal(403, f"This app does not answer to the host name {_host_name(host) or host!r}; open it as "
                            f"http://127.0.0.1 or http://localhost (a page that renames itself to reach the app "
                            f"is refused).")
    origin = header(scope, b"origin")
    changes_state = scope["type"] == "websocket" or scope.get("method", "GET") not in SAFE_METHODS
    if changes_state and origin is not None and not _same_origin(origin, scope):
        return Refusal(403, f"Requests from another site ({origin}) may not use this app.")
    if (json_only_api and scope["type"] == "http" and scope.get("method") == "POST"
            and is_api_path(scope.get("path", ""))):
        content_type = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return Refusal(415, "The request body must be JSON, sent with 'Content-Type: application/json'.")
    return None


def is_api_path(path: str) -> bool:
    """The OpenAI-compatible API's routes: /v1 and the tokenizer beside it (vLLM's place)."""
    return path.startswith("/v1/") or path.rstrip("/") == "/tokenize"


def without_foreign_cors(scope, headers: list[tuple[bytes, bytes]],
                         hosts: HostPolicy | None = None) -> list[tuple[bytes, bytes]]:
    """The response's headers without an Access-Control-Allow-Origin that names another site (or '*'). With
    `hosts`, an origin is the app's own only under a Host it answers to: a rebinding page's Origin and Host
    agree (both name the attacker's site), and the guard's 403 to it must not name that site either."""
    own = own_origin(scope) if hosts is None or hosts.allows(header(scope, b"host") or "") else None
    kept = []
    for name, value in headers:
        if name.lower() == b"access-control-allow-origin":
            origin = value.decode("latin-1")
            if own is None or origin == "*" or not _same_origin(origin, scope):
                continue
        kept.append((name, value))
    return kept


@dataclass
class LoginThrottle(FailureThrottle):
    """At most `attempts` failed logins per client address in any `window_s` seconds; after that every login
    from that address waits (a right password too) until the oldest failure leaves the window. Successful
    logins are not counted: gradio_client logs in each time a Client is made."""

    @staticmethod
    def is_login(scope) -> bool:
        return scope.get("method") == "POST" and scope.get("path") in LOGIN_PATHS

    def wait_before(self, scope, now: float | None = None) -> int | None:
        """None when this request may go on; else the seconds until the client may try again."""
        return self.wait_for(_client(scope), now) if self.is_login(scope) else None

    def record(self, scope, status: int, now: float | None = None) -> None:
        """Note a login's answer: a refusal counts against its client address."""
        if self.is_login(scope) and status >= 400 and status != 429:
            self.note_failure(_client(scope), now)


def ignore_forwarded_headers() -> None:
    """Make uvicorn servers configured after this call keep the connection's own address as the request's
    client. By default uvicorn believes `X-Forwarded-For` (and `X-Forwarded-Proto`) from a loopback peer: any
    local process could then name a new address for each login and never meet `LoginThrottle`. Gradio's
    launch() builds its uvicorn.Config without `forwarded_allow_ips`, so uvicorn reads FORWARDED_ALLOW_IPS:
    empty trusts no peer. The app runs on the user's machine, not behind a proxy; someone who puts it behind
    one sets FORWARDED_ALLOW_IPS to the proxy's address themselves (kept as set), and the throttle then counts
    the addresses that proxy forwards."""
    os.environ.setdefault("FORWARDED_ALLOW_IPS", "")


def _client(scope) -> str:
    return (scope.get("client") or ("unknown", 0))[0]
