"""The page's guard, an ASGI middleware on the app that serves both the page and the API:

- every HTML response gets a Content-Security-Policy that lets the page load scripts, styles, fonts and
  images only from its own origin (images also from data: and blob: URLs), so text in the chat (a user's or
  the model's `<img src=http://...>` or `![](http://...)`) cannot make the browser fetch another host;
- with a key, every Gradio route under /gradio_api/ refuses a caller without the login cookie, besides the
  routes that Gradio itself guards (queue, upload, files, config, info): also cancel, heartbeat, stream and
  run history, and the page's own /live-reply (ui/live_reply.py). The login itself is Gradio's
  (`launch(auth=login_with_key(key))`); /v1 keeps its bearer key;
- other sites cannot use the app through the user's browser (ui/site_checks.py): a Host that is neither a
  loopback name, an IP address nor one the app was told of is refused (DNS rebinding), a state-changing
  request or a WebSocket from another Origin is refused, without a key a POST to /v1 must say
  `application/json` (a cross-site form or `text/plain` fetch cannot), and no CORS header ever names another origin;
- /login takes a few failed attempts a minute per client address, and so does the API's bearer key (after
  that, 429 with Retry-After until the oldest failure is a minute old; ui/failure_throttle.py);
- a client address has at most a few POSTs to the API and the upload route in flight (ui/client_slots.py);
  one more gets 429;
- an upload larger than MAX_UPLOAD_BYTES is refused by its declared length (413), and one that sends more than
  it declared is cut off at the bound (ui/request_limits.py).

    hosts = HostPolicy.listening_on(args.host)
    app_kwargs["middleware"] = [Middleware(PageGuard, key="secret", hosts=hosts)]
    demo.launch(app_kwargs=app_kwargs, ...)
    filter_cors_of(demo.app, hosts)   # Gradio's own CORS middleware sits outside PageGuard: filter around it too
"""

from __future__ import annotations

import hmac
import html
import json
from http.cookies import SimpleCookie

from .client_slots import RETRY_AFTER_S, ClientSlots, client_address
from .failure_throttle import FailureThrottle
from .live_reply import LIVE_REPLY_PATH
from .request_limits import MAX_UPLOAD_BYTES, receive_at_most, upload_refusal
from .site_checks import (
    HostPolicy,
    LoginThrottle,
    cross_site_refusal,
    header,
    is_api_path,
    without_foreign_cors,
)

# 'unsafe-inline' / 'unsafe-eval': Gradio's page sets inline styles and its frontend compiles some code at run
# time; neither lets chat text reach another host, which is what this policy is for.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; "
    "script-src 'self' 'unsafe-inline' 'unsafe-eval' blob:; "
    "style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; "
    "media-src 'self' data: blob:; "
    "font-src 'self' data:; "
    "connect-src 'self'; "
    "worker-src 'self' blob:; "
    "frame-src 'self'; "
    "object-src 'none'; "
    "base-uri 'self'; "
    "form-action 'self'"
)
LOGIN_USER_HINT = "any user name"

# what the login page needs before there is a cookie, and startup-events, which launch() calls itself (it runs
# the app's startup once and answers nothing)
OPEN_GRADIO_PATHS = frozenset({"/gradio_api/login_check", "/gradio_api/login_check/", "/gradio_api/theme.css",
                               "/gradio_api/startup-events"})


def login_with_key(key: str):
    """Gradio's `auth` callable: any user name, the key as the password."""
    def check(username: str, password: str) -> bool:  # noqa: ARG001  the user name is only a label
        return hmac.compare_digest(password.encode(), key.encode())
    return check


def _signed_in(scope) -> bool:
    app = scope.get("app")  # Gradio's App (Starlette sets it before the middleware stack runs)
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not tokens or cookie_id is None:
        return False
    raw = b"; ".join(value for name, value in scope.get("headers", ()) if name == b"cookie").decode("latin-1")
    cookies = SimpleCookie()
    try:
        cookies.load(raw)
    except Exception:  # noqa: BLE001  a malformed cookie header is no login
        return False
    return any(name in cookies and cookies[name].value in tokens
               for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"))


def _is_page_load(scope) -> bool:
    """A browser opening a page (not a script's fetch): it asks for HTML."""
    accept = b",".join(value for name, value in scope.get("headers", ()) if name == b"accept")
    return scope.get("method") == "GET" and b"text/html" in accept


def refusal_page(status: int, message: str) -> bytes:
    """What a browser shows for a refused page load: the sentence itself, not the API's JSON (no script, no
    resource from anywhere)."""
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>InfiniGen Chat: {status}</title>"
            f"</head><body style=\"font-family:sans-serif;max-width:40em;margin:4em auto\"><h1>InfiniGen Chat</h1>"
            f"<p>{html.escape(message)}</p></body></html>").encode()


_ERROR_KINDS = {401: ("invalid_request_error", "invalid_api_key"), 403: ("invalid_request_error", "forbidden"),
                429: ("rate_limit_error", "rate_limit_exceeded")}


NO_KEY = "this server needs an API key: send it as 'Authorization: Bearer KEY'"
WRONG_KEY = "incorrect API key"


def bearer_refusal(authorization: str, key: str | None) -> str | None:
    """Why an `Authorization` header does not carry the API key (None: it does, or no key is set): NO_KEY or
    WRONG_KEY (a guess, which the key throttle counts)."""
    if key is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return NO_KEY
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        return WRONG_KEY
    return None


async def _refuse(scope, send, status: int, message: str, headers: tuple = ()) -> None:
    """A refusal in the API's error shape (OpenAI's `{"error": {...}}`, whose `detail` Gradio's page shows as a
    sentence too), or, to a browser opening a page, a page that says the sentence."""
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1008})
    if _is_page_load(scope):
        body, content_type = refusal_page(status, message), b"text/html; charset=utf-8"
    else:
        kind, code = _ERROR_KINDS.get(status, ("invalid_request_error", None))
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code},
                           "detail": {"error": message}}).encode()
        content_type = b"application/json"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            (b"x-content-type-options", b"nosniff"), *headers]})
    await send({"type": "http.response.body", "body": body})


class ForeignCorsFilter:
    """ASGI wrapper that removes an Access-Control-Allow-Origin naming another origin from every answer (any
    origin, under a Host that `hosts` refuses)."""

    def __init__(self, app, hosts: HostPolicy | None = None) -> None:
        self.app = app
        self.hosts = hosts if hosts is not None else HostPolicy()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_filtered(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message,
                           "headers": without_foreign_cors(scope, list(message.get("headers", ())), self.hosts)}
            await send(message)

        await self.app(scope, receive, send_filtered)


def filter_cors_of(app, hosts: HostPolicy | None = None) -> None:
    """Put a ForeignCorsFilter around the whole of a Starlette app's middleware stack. Gradio adds its CORS
    middleware itself, outside every middleware given to launch(), and it names the request's Origin when the
    Host is not a loopback name (a LAN address) or the Origin is one (another local port), a rebinding
    page's included: only a filter around it can take that back. `hosts`: the guard's. Call once, after
    launch() (which builds the stack)."""
    stack = app.middleware_stack if app.middleware_stack is not None else app.build_middleware_stack()
    if not isinstance(stack, ForeignCorsFilter):
        app.middleware_stack = ForeignCorsFilter(stack, hosts)


class PageGuard:
    def __init__(self, app, key: str | None = None, hosts: HostPolicy | None = None,
                 login_throttle: LoginThrottle | None = None, max_upload_bytes: int = MAX_UPLOAD_BYTES,
                 client_slots: ClientSlots | None = None, key_throttle: FailureThrottle | None = None) -> None:
        self.app, self.key, self.max_upload_bytes = app, key, max_upload_bytes
        self.hosts = hosts if hosts is not None else HostPolicy()
        self.login_throttle = login_throttle if login_throttle is not None else LoginThrottle()
        self.key_throttle = key_throttle if key_throttle is not None else FailureThrottle()
        self.client_slots = client_slots if client_slots is not None else ClientSlots()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        refusal = cross_site_refusal(scope, self.hosts, json_only_api=self.key is None)
        if refusal is not None:
            return await _refuse(scope, send, refusal.status, refusal.message)
        path = scope.get("path", "")
        if (self.key is not None and (path.startswith("/gradio_api/") or path == LIVE_REPLY_PATH)
                and path not in OPEN_GRADIO_PATHS and not _signed_in(scope)):
            return await _refuse(scope, send, 401, "Not authenticated: log in with the app's key")
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        wait = self.login_throttle.wait_before(scope)
        if wait is not None:
            return await _refuse(scope, send, 429, f"Too many login attempts; try again in {wait} seconds.",
                                 ((b"retry-after", str(wait).encode()),))
        too_large = upload_refusal(scope, self.max_upload_bytes)
        if too_large is not None:
            return await _refuse(scope, send, 413, too_large)
        if is_api_path(path) and self.key is not None:  # a client without the key holds no slot
            if (refused := self._key_refusal(scope)) is not None:
                return await _refuse(scope, send, *refused)
        slot = self.client_slots.claim(scope)
        if slot.refused:
            return await _refuse(scope, send, 429, self.client_slots.refusal(),
                                 ((b"retry-after", str(RETRY_AFTER_S).encode()),))
        if scope.get("method") == "POST":
            receive = receive_at_most(receive, self.max_upload_bytes)

        async def send_with_policy(message) -> None:
            if message["type"] == "http.response.start":
                self.login_throttle.record(scope, message["status"])
                headers = without_foreign_cors(scope, list(message.get("headers", ())))
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if content_type.startswith(b"text/html"):
                    headers.append((b"content-security-policy", CONTENT_SECURITY_POLICY.encode()))
                    headers.append((b"x-content-type-options", b"nosniff"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_policy)
        finally:  # the response's last byte is sent, or the client went away
            slot.release()

    def _key_refusal(self, scope) -> tuple[int, str, tuple] | None:
        """Why an API request may not go on for its key: its address sent too many wrong keys lately (429, every
        key refused until Retry-After: see ui/failure_throttle.py), or its key is missing or wrong (401)."""
        address = client_address(scope)
        wait = self.key_throttle.wait_for(address)
        if wait is not None:
            return (429, f"Too many wrong API keys from this address; try again in {wait} seconds.",
                    ((b"retry-after", str(wait).encode()),))
        refusal = bearer_refusal(header(scope, b"authorization") or "", self.key)
        if refusal is None:
            return None
        if refusal == WRONG_KEY:  # a guess; a missing key is not (a client that forgot it learns so at once)
            self.key_throttle.note_failure(address)
        return 401, refusal, ()
