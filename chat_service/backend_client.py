"""An HTTP client for an OpenAI-compatible server that generates the app's replies (`python app.py --backend
URL`): vLLM's `vllm serve`, llama.cpp's server, or another instance of this app.

    client = BackendClient(BackendConfig("http://gpu-box:8000/v1", key="secret"))
    client.probe()                                   # the model and its window, from GET /v1/models
    with client.reply(messages, sampling) as stream:  # BackendError when the server refuses: nothing was sent back
        for piece in stream.pieces(cancel): ...       # text as it streams; leaving early closes the upstream request

Every failure is a `BackendError` (a UserError) that says what went wrong and what to do, with the HTTP status
our own API answers with. Nothing here waits forever: connecting and each read have their timeouts.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from infinigen_core import SamplingConfig

from .errors import UserError

BUSY_RETRIES = 2  # a 429 or 503 before the reply starts is tried again this often
BUSY_WAIT_CAP_S = 5.0  # the longest a Retry-After is honoured before the user is told to retry
CONTEXT_WORDS = ("context", "window", "too long", "maximum", "max_model_len")


@dataclass(frozen=True)
class BackendConfig:
    """Where replies are generated: the server's OpenAI base URL (ending in /v1), its key, the model to ask for
    (None: the first one it lists), and how long to wait for a connection and for each piece of a reply."""

    url: str
    key: str | None = None
    model: str | None = None
    connect_timeout_s: float = 5.0
    # between two pieces of a reply, the first included: a long prompt's prefill on a busy server takes a while
    read_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        parsed = urlparse(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"the backend URL must be http(s)://HOST[:PORT]/v1, got {self.url!r}")
        if self.key is not None and not self.key.strip():
            raise ValueError("the backend key is empty: give a key, or leave it out")
        if self.model is not None and not self.model.strip():
            raise ValueError("the backend model name is empty: give a name, or leave it out")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("the backend timeouts must be positive")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    @property
    def root(self) -> str:
        """The server's own root, beside its OpenAI base: where vLLM and llama.cpp serve /tokenize."""
        return self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base


class BackendError(UserError):
    """A backend failure, said for the user; `status`, `code` and `retry_after` are what our API answers with."""

    def __init__(self, message: str, status: int = 502, code: str = "backend_error",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after


@dataclass(frozen=True)
class BackendModel:
    name: str
    window: int | None  # the model's context window when the server says it (vLLM: max_model_len)


@dataclass
class TurnFigures:
    """What a remote engine tells about one reply, for the page's panels and our API's usage."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache held (when it reports them)
    pieces: int = 0  # streamed pieces with text (about one token each)
    started: float = 0.0
    first_piece_at: float | None = None
    ended_at: float | None = None

    def time_to_first_token(self) -> float | None:
        return None if self.first_piece_at is None else self.first_piece_at - self.started

    def tokens_per_second(self) -> float:
        if self.first_piece_at is None:
            return 0.0
        tokens = self.completion_tokens if self.completion_tokens is not None else self.pieces
        spent = (self.ended_at or time.perf_counter()) - self.first_piece_at
        return max(tokens - 1, 0) / spent if spent > 0 else 0.0


@dataclass(frozen=True)
class Piece:
    text: str
    finish_reason: str | None = None  # the server's: stop | length | ...


def _error_text(response: httpx.Response) -> tuple[str, str]:
    """The server's own error message and code, from OpenAI's error shape or whatever body it sent."""
    try:
        body = json.loads(response.read() or b"{}")
    except ValueError:
        return response.text[:300].strip(), ""
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or json.dumps(error)[:300]
        return str(message), str(error.get("code") or "")
    return str(error)[:300], ""


class BackendClient:
    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        headers = {"Authorization": f"Bearer {config.key}"} if config.key else {}
        self._http = httpx.Client(base_url=config.base, timeout=timeout, headers=headers)
        self.model: BackendModel | None = None  # known once probed
        self.last = TurnFigures()  # the latest reply's figures

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ the model
    def probe(self) -> BackendModel:
        """The model replies come from, and its window where the server reports it (GET /v1/models)."""
        response = self._send("GET", "/models")
        try:
            listed = [entry for entry in response.json()["data"] if isinstance(entry, dict) and entry.get("id")]
        except (ValueError, KeyError, TypeError):
            raise BackendError(f"The backend at {self.config.url} answered /models with something that is not an "
                               "OpenAI model list: is the URL the server's OpenAI base (ending in /v1)?") from None
        names = [str(entry["id"]) for entry in listed]
        wanted = self.config.model or (names[0] if names else None)
        if wanted is None:
            raise BackendError(f"The backend at {self.config.url} lists no model.")
        if self.config.model and names and wanted not in names:
            raise BackendError(f"The backend at {self.config.url} serves no model {wanted!r}; it serves "
                               f"{', '.join(map(repr, names))}. Fix --backend-model.", 502, "model_not_found")
        entry = next((entry for entry in listed if entry["id"] == wanted), {})
        self.model = BackendModel(wanted, None)
        self.learn_window(entry.get("max_model_len"))
        return self.model

    def learn_window(self, window) -> None:
        """Take the model's window where the server says it (its model list, or vLLM's /tokenize answer)."""
        if self.model is not None and self.model.window is None and isinstance(window, int) and window > 0:
            self.model = BackendModel(self.model.name, window)

    def model_name(self) -> str:
        return self.model.name if self.model is not None else (self.config.model or "")

    # ------------------------------------------------------------------ a reply
    def request_body(self, messages: list[dict], sampling: SamplingConfig) -> dict:
        """Sampling as OpenAI's fields; top_k and repetition_penalty (which vLLM and llama.cpp take, OpenAI
        does not) only when they are set, so a strict server is not refused them."""
        body: dict = {"model": self.model_name() or None, "messages": messages, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": sampling.temperature,
                      "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop_strings:
            body["stop"] = list(sampling.stop_strings)
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        return {key: value for key, value in body.items() if value is not None}

    @contextlib.contextmanager
    def reply(self, messages: list[dict], sampling: SamplingConfig) -> Iterator[ReplyStream]:
        """A streaming reply the server has accepted (BackendError otherwise, before anything streamed); the
        upstream request is closed when the block ends, however it ends."""
        if self.model is None:
            self.probe()  # the server may have come up after the app: learn its model now
        body = self.request_body(messages, sampling)
        started = time.perf_counter()  # the time to first token counts the server's reading of the prompt
        for attempt in range(BUSY_RETRIES + 1):
            with self._stream("POST", "/chat/completions", body) as response:
                if response.status_code in (429, 503) and attempt < BUSY_RETRIES:
                    wait = _retry_after(response)
                    if wait <= BUSY_WAIT_CAP_S:
                        time.sleep(wait)
                        continue
                if response.status_code != 200:
                    raise self.refusal(response)
                self.last = TurnFigures(started=started)
                yield ReplyStream(response, self.last, self.config.url)
                return

    @contextlib.contextmanager
    def _stream(self, method: str, path: str, body: dict) -> Iterator[httpx.Response]:
        try:
            with self._http.stream(method, path, json=body) as response:
                yield response
        except httpx.HTTPError as error:
            raise self._transport_error(error) from None

    def server_post(self, path: str, body: dict) -> httpx.Response:
        """POST `body` to `path` at the server's root (not under /v1) and return the answer whatever its status;
        only a failed connection is a BackendError here."""
        try:
            return self._http.post(self.config.root + path, json=body)
        except httpx.HTTPError as error:
            raise self._transport_error(error) from None

    def _send(self, method: str, path: str) -> httpx.Response:
        try:
            response = self._http.request(method, path)
        except httpx.HTTPError as error:
            raise self._transport_error(error) from None
        if response.status_code != 200:
            raise self.refusal(response)
        return response

    # ------------------------------------------------------------------ what went wrong, in words
    def _transport_error(self, error: httpx.HTTPError) -> BackendError:
        url = self.config.url
        if isinstance(error, httpx.ConnectTimeout):
            return BackendError(f"Cannot reach the backend at {url}: no connection within "
                                f"{self.config.connect_timeout_s:g} s. Is the host right and the server up?", 502,
                                "backend_unreachable")
        if isinstance(error, httpx.ConnectError):
            return BackendError(f"Cannot reach the backend at {url} ({error}). Is the server running, and the URL "
                                "its OpenAI base (http://HOST:PORT/v1)?", 502, "backend_unreachable")
        if isinstance(error, httpx.TimeoutException):
            return BackendError(f"The backend at {url} sent nothing for {self.config.read_timeout_s:g} s; gave up.",
                                504, "backend_timeout")
        return BackendError(f"The connection to the backend at {url} failed ({type(error).__name__}: {error}).",
                            502, "backend_connection_lost")

    def refusal(self, response: httpx.Response) -> BackendError:
        status, url = response.status_code, self.config.url
        message, code = _error_text(response)
        said = f"(HTTP {status}: {message})" if message else f"(HTTP {status})"
        if status in (401, 403):
            return BackendError(f"The backend at {url} refused the key {said}. Check --backend-key.", 502,
                                "backend_auth")
        if status == 404 and ("model" in code or "model" in message.lower()):
            return BackendError(f"The backend at {url} has no model {self.model_name()!r} {said}. Fix "
                                "--backend-model.", 502, "model_not_found")
        if status == 404:
            return BackendError(f"The backend at {url} has no such endpoint {said}: the URL should be the "
                                "server's OpenAI base, ending in /v1.", 502, "backend_not_found")
        if status == 400 and (code == "context_length_exceeded" or any(w in message.lower() for w in CONTEXT_WORDS)):
            return BackendError(f"The conversation does not fit the backend model's window {said}. Start a new "
                                "session or send less. Nothing was stored.", 400, "context_length_exceeded")
        if status in (429, 503):
            wait = max(1, round(_retry_after(response)))
            return BackendError(f"The backend at {url} is busy {said}; retry in {wait} s.", 503, "backend_busy",
                                retry_after=wait)
        if 400 <= status < 500:
            return BackendError(f"The backend at {url} refused the request {said}.", 400, "backend_refused")
        return BackendError(f"The backend at {url} failed {said}.", 502, "backend_failed")


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("retry-after", "1")), 0.0)
    except ValueError:
        return 1.0


class ReplyStream:
    """An accepted reply's pieces, read from the server's event stream."""

    def __init__(self, response: httpx.Response, figures: TurnFigures, url: str) -> None:
        self._response, self.figures, self._url = response, figures, url

    def pieces(self, cancel) -> Iterator[Piece]:
        """The reply's text as it comes. Stops at once when `cancel` is set (the caller then leaves the block,
        which closes the upstream request, so the server stops too); BackendError when the server fails or the
        connection breaks mid-reply (what came before was yielded), or when the stream ends unfinished."""
        finished = False
        try:
            for line in self._response.iter_lines():
                if cancel is not None and cancel.is_set():
                    return
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                for piece in self._read_event(data):
                    finished = finished or piece.finish_reason is not None
                    yield piece
            if not finished and not (cancel is not None and cancel.is_set()):
                raise self._unfinished()
        except httpx.HTTPError as error:
            raise BackendError(f"The backend at {self._url} stopped mid-reply ({type(error).__name__}: {error}); "
                               "the part received is kept.", 502, "backend_connection_lost") from None
        finally:
            self.figures.ended_at = time.perf_counter()

    def _unfinished(self) -> BackendError:
        """A stream closed without an end marker: the server failed while generating. (llama.cpp's Python server
        answers a prompt over its window so: 200, then an empty stream; its log says why.)"""
        if self.figures.pieces:
            return BackendError(f"The backend at {self._url} stopped mid-reply (its stream ended unfinished); the "
                                "part received is kept.", 502, "backend_connection_lost")
        return BackendError(f"The backend at {self._url} closed its reply without a word or an end marker: it failed "
                            "while generating (a prompt over its window does this on some servers; its log says "
                            "why). Nothing was stored.", 502, "backend_failed")

    def _read_event(self, data: str) -> Iterator[Piece]:
        try:
            event = json.loads(data)
        except ValueError:
            return  # a comment or keep-alive some servers send
        if not isinstance(event, dict):
            return
        if "error" in event:
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise BackendError(f"The backend at {self._url} failed mid-reply ({message}); the part received is "
                               "kept.", 502, "backend_failed")
        self._take_usage(event.get("usage"))
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text, finish = delta.get("content") or "", choice.get("finish_reason")
            if text:
                self.figures.pieces += 1
                if self.figures.first_piece_at is None:
                    self.figures.first_piece_at = time.perf_counter()
            if text or finish:
                yield Piece(text, finish)

    def _take_usage(self, usage) -> None:
        if not isinstance(usage, dict):
            return
        figures = self.figures
        figures.prompt_tokens = usage.get("prompt_tokens", figures.prompt_tokens)
        figures.completion_tokens = usage.get("completion_tokens", figures.completion_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            figures.cached_tokens = details["cached_tokens"]
