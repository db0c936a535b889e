"""The OpenAI API's serving logic: the checks before a turn, the turn in a worker thread, the reply in
OpenAI's shapes (one completion or a stream of chunks).

A generation runs in a worker thread that feeds the response; a client that goes away sets its cancel
flag, and what was generated is stored.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse

from chat_service import Abandoned, ChatService, QueueFull, UserError
from chat_service.api_turns import ApiTurn
from chat_service.backend_client import BackendError, TurnFigures
from chat_service.remote_host import RemoteHost
from documents import attachment_text
from documents.fitting import reading_summary
from infinigen_core import GenerationEvent, chat_token_ids
from sessions import ContextWindowError
from sessions.chat import conversation, reply_prompt_ids

from ..guard import bearer_refusal
from ..request_limits import JsonTooDeep, check_json_nesting
from .protocol import ApiError, ChatRequest, TokenizeRequest

LOADING_RETRY_S = 5
BUSY_RETRY_S = 2
FINISH_REASONS = {"eos": "stop", "stop": "stop", "cancelled": "stop", "length": "length", "window": "length"}
DISCONNECT_POLL_S = 0.25
# A request body is refused over this size before it is read whole (413): room for a 20 MiB attachment sent
# base64-encoded in a `file` part (4/3 of it, 26.7 MiB) and the conversation around it.
MAX_BODY_BYTES = 32 * 1024 * 1024
# A body must have come whole within this long (a slow sender holds a connection and its buffer open): 32 MiB
# at 1 MiB/s, far below what a client on this machine or a LAN sends
BODY_DEADLINE_S = 30.0


# ---------------------------------------------------------------------- checks before a turn
def check_key(request: Request, key: str | None) -> None:
    refusal = bearer_refusal(request.headers.get("authorization", ""), key)
    if refusal is not None:
        raise ApiError(401, refusal, None, "invalid_api_key")


def served_model(service: ChatService) -> str:
    host = service.host
    if isinstance(host, RemoteHost) and host.connected:
        try:
            return host.served_model()
        except BackendError as error:
            raise backend_api_error(error) from None
    if not host.ready.is_set():
        raise ApiError(503, f"the model is still loading ({host.status}); retry shortly", None,
                       "model_loading", "server_error", retry_after=LOADING_RETRY_S)
    if host.engine is None:
        raise ApiError(503, host.load_error or "the model is not loaded", None, "model_not_loaded",
                       "server_error")
    return host.engine.model_name


def served_window(service: ChatService) -> int | None:
    """The served model's window in tokens, where known."""
    host = service.host
    if isinstance(host, RemoteHost):
        return host.window()
    return host.engine.max_context if host.engine is not None else None


def _too_large(size: str) -> ApiError:
    return ApiError(413, f"the request body is {size}; this server takes at most {MAX_BODY_BYTES // 2**20} MiB",
                    None, "request_too_large")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, deadline_s: float = BODY_DEADLINE_S) -> bytes:
    """The body, refused by its Content-Length, or while it streams in once it passes `limit` (a client may
    send no length, or a wrong one): never more than `limit` bytes are held. A body not whole within
    `deadline_s` is refused too (408), so a client trickling bytes cannot hold the request open."""
    length = request.headers.get("content-length", "")
    if length.strip().isdigit() and int(length) > limit:
        raise _too_large(f"{int(length):,} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"over {limit:,} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {deadline_s:g} s ({size:,} bytes came); "
                            f"send it at once", None, "request_timeout") from None
    return b"".join(chunks)


async def json_body(request: Request):
    body = await read_body(request)
    try:
        return await asyncio.to_thread(lambda: json.loads(check_json_nesting(body)))  # 32 MiB of JSON: off the loop
    except JsonTooDeep as error:
        raise ApiError(400, f"the request body is nested too deeply: {error}", None, "invalid_json") from None
    except ValueError as error:
        raise ApiError(400, f"the request body is not valid JSON ({error})", None, "invalid_json") from None


@dataclass(frozen=True)
class DocumentsRead:
    """What the model reads of a request's files: per file 'report.pdf: pages 1, 36-38' (read by passages) or
    'notes.txt: whole', and their tokens as placed in the prompt."""

    descriptions: tuple[str, ...] = ()
    tokens: int = 0

    def header(self) -> str:
        """The files' descriptions joined by '; ', each percent-encoded past printable ASCII (a header is
        latin-1) and where it holds ';' or '%', so a client splits and decodes it without guessing."""
        return "; ".join(urllib.parse.quote(text, safe=_HEADER_SAFE) for text in self.descriptions)


# printable ASCII but the two characters the header's own format uses
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in ";%")


def with_documents_read(service: ChatService, chat_request: ChatRequest) -> tuple[ChatRequest, DocumentsRead]:
    """The request with each file that does not fit the window read by passages for its turn's question (the
    page's rule: chat_service.document_reading), and what is read of every file."""
    asked = chat_request.conversation
    if not any(asked.documents) or service.host.remote:  # a remote server checks its own window
        return chat_request, DocumentsRead()
    engine = service.host.require_engine_loaded()
    try:
        asked = service.documents.for_api(asked, engine)
    except UserError as error:  # its passages could not be indexed: nothing was stored
        raise ApiError(500, str(error), "messages", "document_read_failed", "server_error") from None
    files = [document for turn in asked.documents for document in turn]
    tokens = sum(len(engine.tokenizer.encode(attachment_text(d), add_special_tokens=False)) for d in files)
    return replace(chat_request, conversation=asked), DocumentsRead(tuple(reading_summary(files)), tokens)


def checked_prompt_ids(service: ChatService, chat_request: ChatRequest) -> list[int]:
    """The templated conversation, checked against the model's window (the page's rule and wording) before
    anything is stored. With a remote backend the app has no tokenizer: the server checks its own window."""
    if isinstance(service.host, RemoteHost):
        return _check_remote_window(service.host, chat_request)
    engine, asked = service.host.require_engine_loaded(), chat_request.conversation
    _refuse_beyond_any_window(engine, len(asked.system) + sum(len(content) for _, content in asked.turns),
                              "the conversation", "messages")
    try:
        return reply_prompt_ids(engine.tokenizer, conversation(asked.system, list(asked.turns)), engine.max_context)
    except ContextWindowError as error:
        attached = bool(asked.documents and asked.documents[-1])
        passages = attached and any(document.read is not None for document in asked.documents[-1])
        raise ApiError(400, error.check.explain(attached, passages), "messages", "context_length_exceeded") from None


def _refuse_beyond_any_window(engine, characters: int, what: str, param: str) -> None:
    """Refuse a text that no tokenization could fit in the window, before the tokenizer spends seconds on it."""
    most = engine.max_context * longest_token_characters(engine.tokenizer)
    if characters > most:
        raise ApiError(400, f"{what} is {characters:,} characters long: with the model's window of "
                            f"{engine.max_context:,} tokens, none of which covers more than "
                            f"{most // engine.max_context} characters, at most {most:,} can ever fit",
                       param, "context_length_exceeded")


def _check_remote_window(host: RemoteHost, chat_request: ChatRequest) -> list[int]:
    """The page's window rule and wording, counted by the server's tokenizer where it serves one; no ids (the
    server templates the conversation itself)."""
    asked = chat_request.conversation
    try:
        check = host.window_check(conversation(asked.system, list(asked.turns)))
    except BackendError as error:
        raise backend_api_error(error) from None
    if not check.fits:
        attached = bool(asked.documents and asked.documents[-1])
        raise ApiError(400, check.explain(attached), "messages", "context_length_exceeded")
    return []


def backend_api_error(error: BackendError) -> ApiError:
    return ApiError(error.status, str(error), None, error.code, "invalid_request_error" if error.status == 400
                    else "server_error", error.retry_after)


def require_local_tokenizer(service: ChatService) -> None:
    """/tokenize needs this app's own model: a front whose replies come from a backend says so (501)."""
    if isinstance(service.host, RemoteHost):
        raise ApiError(501, f"this app's replies come from the backend at {service.host.client.config.url}; ask "
                            "that server to count tokens", None, "not_implemented", "server_error")


def tokenize(service: ChatService, asked: TokenizeRequest) -> dict:
    """vLLM's answer to POST /tokenize: the served model's tokens for a chat (exactly those a turn would read,
    attached files whole) or a text, their count and the model's window. A text no window could hold is
    refused as a turn's would be (the tokenizer is not spent on it)."""
    require_local_tokenizer(service)
    engine = service.host.require_engine_loaded()
    if asked.conversation is not None:
        chat = asked.conversation
        _refuse_beyond_any_window(engine, len(chat.system) + sum(len(content) for _, content in chat.turns),
                                  "the conversation", "messages")
        ids = chat_token_ids(engine.tokenizer, conversation(chat.system, list(chat.turns)), asked.add_generation_prompt)
    else:
        _refuse_beyond_any_window(engine, len(asked.prompt or ""), "the prompt", "prompt")
        ids = list(engine.tokenizer.encode(asked.prompt or "", add_special_tokens=asked.add_special_tokens))
    return {"count": len(ids), "tokens": ids, "max_model_len": engine.max_context}


_longest_token: dict[int, tuple[object, int]] = {}


def longest_token_characters(tokenizer) -> int:
    """The most characters one token of this vocabulary (added tokens included) stands for: a text longer
    than window × this can never fit the window, whatever it says. Measured on the token strings, which
    have at least one character per character of text (a byte-level token has one per byte)."""
    known = _longest_token.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        vocabulary = tokenizer.get_vocab()
        longest = max(map(len, vocabulary), default=1)
        known = _longest_token[id(tokenizer)] = (tokenizer, max(longest, 1))
    return known[1]


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# ---------------------------------------------------------------------- the turn, in a worker thread
class Generation:
    """Runs the service's API turn in a thread and hands its events to the event loop, in order."""

    def __init__(self, service: ChatService, chat_request: ChatRequest, prompt_ids: list[int],
                 max_waiting: int) -> None:
        self.cancel = threading.Event()
        self.turn = ApiTurn()
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()
        args = (chat_request.conversation, prompt_ids, self.cancel, self.turn, max_waiting)
        self._thread = threading.Thread(target=self._run, args=(service, args), daemon=True,
                                        name="api-generation")
        self._thread.start()

    def _run(self, service: ChatService, args: tuple) -> None:
        def put(item: object) -> None:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)

        try:
            for event in service.api.answer(*args):
                put(event)
            put(None)
        except QueueFull as error:
            put(ApiError(429, str(error), None, "rate_limit_exceeded", "rate_limit_error", BUSY_RETRY_S))
        except Abandoned as error:
            put(ApiError(499, str(error), None, "client_closed_request"))
        except BackendError as error:  # the remote server's refusal or failure, said for the client
            put(backend_api_error(error))
        except UserError as error:
            put(ApiError(500, str(error), None, "generation_failed", "server_error"))
        except Exception as error:  # noqa: BLE001  the client gets a message instead of a dropped connection
            put(ApiError(500, f"generation failed: {error}", None, "generation_failed", "server_error"))

    async def next_item(self) -> GenerationEvent | None:
        item = await self._items.get()
        if isinstance(item, ApiError):
            raise item
        return item

    async def next_item_while_connected(self, request: Request) -> GenerationEvent | None:
        """The next event, waiting (for the turn, the prefill, the token) only as long as the client stays."""
        while True:
            try:
                return await asyncio.wait_for(self.next_item(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel.set()  # the worker stops at the next token and stores what it has


# ---------------------------------------------------------------------- the reply, in OpenAI's shapes
def remote_usage(figures: TurnFigures) -> dict:
    """The usage a remote server reported (its streamed pieces stand in for a completion count it did not send)."""
    prompt = figures.prompt_tokens or 0
    completion = figures.completion_tokens if figures.completion_tokens is not None else figures.pieces
    usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if figures.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": figures.cached_tokens}
    return usage


class Reply:
    def __init__(self, model_id: str, prompt_tokens: int, turn: ApiTurn,
                 documents: DocumentsRead = DocumentsRead()) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id, self.prompt_tokens, self.turn, self.documents = model_id, prompt_tokens, turn, documents
        self.text, self.completion_tokens = "", 0
        self.finish_reason: str | None = None

    def add(self, event: GenerationEvent) -> str:
        if event.token_id is not None:
            self.completion_tokens += 1
        if event.finish_reason is not None:
            self.finish_reason = FINISH_REASONS.get(event.finish_reason, "stop")
        self.text += event.text
        return event.text

    def usage(self) -> dict:
        figures = self.turn.figures
        if figures is not None:  # a remote server generated: its own counts, where it sent them
            return remote_usage(figures)
        cached = max(self.prompt_tokens - self.turn.prefilled_tokens, 0)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.documents.descriptions:  # of the prompt tokens, those of the files (what was read of them)
            usage["document_tokens_read"] = self.documents.tokens
        return usage

    def headers(self) -> dict:
        """Known before the first token: the session answered in, whether it continued a stored one, and what
        was read of the request's files."""
        headers = {"x-infinigen-session": self.turn.session_id,
                   "x-infinigen-continued": "true" if self.turn.continued else "false"}
        if self.documents.descriptions:
            headers["x-infinigen-document-read"] = self.documents.header()
        return headers

    def completion(self) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text},
                             "finish_reason": self.finish_reason, "logprobs": None}],
                "usage": self.usage(), "system_fingerprint": None}

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
        return f"data: {json.dumps(chunk)}\n\n"

    async def collect(self, job: Generation, event: GenerationEvent | None, request: Request) -> None:
        while event is not None:
            self.add(event)
            event = await job.next_item_while_connected(request)

    async def stream(self, job: Generation, event: GenerationEvent | None, include_usage: bool) -> AsyncIterator[str]:
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            while event is not None:
                delta = self.add(event)
                if delta:
                    yield self._chunk({"content": delta})
                event = await job.next_item()
            yield self._chunk({}, self.finish_reason or "stop")
            if include_usage:
                usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model_id, "choices": [], "usage": self.usage()}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        except ApiError as error:  # a failure after the first token: the status is sent, say it in the stream
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:  # the client went away (or the stream ended): stop generating, keep what was generated
            job.cancel.set()
