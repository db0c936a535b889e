"""An OpenAI chat-completions request body (and vLLM's POST /tokenize body), checked in one place and turned
into what the app runs.

    request = parse_chat_request(body, model_id="SmolLM2-135M-Instruct", defaults=SamplingConfig())
    request.conversation.system, request.conversation.turns, request.conversation.sampling, request.stream
    parse_tokenize_request({"messages": [{"role": "user", "content": "Hi"}]}, "SmolLM2-135M-Instruct").conversation

It converts attached files (PDF, DOCX...), which can take seconds: the route calls it off the event loop.

Every problem raises `ApiError` with OpenAI's error fields (message, type, param, code) and an HTTP status;
nothing is stored before a request has passed here.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, replace

from chat_service.api_turns import Conversation
from documents import MAX_FILE_BYTES, Document, DocumentError, convert_bytes, message_with_attachments
from infinigen_core import ConfigError, SamplingConfig

# integers are bounded before they reach the sampler: torch's generator takes a signed 64-bit seed, and a
# reply is cut at the model's window anyway (a bound here keeps a huge number out of the arithmetic)
SEED_BOUNDS = (-(2**63), 2**63 - 1)
MAX_TOKENS_BOUND = 2**31 - 1
SYSTEM_ROLES = ("system", "developer")  # "developer" is what newer OpenAI clients call the system prompt
CHAT_ROLES = ("user", "assistant")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    conversation: Conversation  # the system prompt, the turns, their files, the sampling
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts


@dataclass(frozen=True)
class _Content:
    text: str  # what the model reads: the attached files' text, then the question
    question: str  # the message's own text
    documents: tuple[Document, ...] = ()


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code or "invalid_value")


def _content(message: dict, index: int) -> _Content:
    param = f"messages[{index}].content"
    content = message.get("content")
    if content is None:
        if message.get("tool_calls") or message.get("function_call"):
            raise _bad("tool calls are not supported: this server has no tools", param, "unsupported_value")
        return _Content("", "")
    if isinstance(content, str):
        return _Content(content, content)
    if isinstance(content, list):
        parts, documents = [], []
        for number, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "file" and message.get("role") == "user":
                documents.append(_file_part(part, f"{param}[{number}]"))
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("only text parts ({\"type\": \"text\", \"text\": ...}) and, in user messages, file "
                           "parts ({\"type\": \"file\", \"file\": {\"filename\": ..., \"file_data\": "
                           "\"data:<mime>;base64,...\"}}) are supported", param, "unsupported_value")
            parts.append(part["text"])
        # the documents go before the question, in one fixed format: the same file gives the same tokens in
        # any conversation, so a new one shares the stored KV of an earlier one (documents.prompt)
        question = "".join(parts).strip() if documents else "".join(parts)
        return _Content(message_with_attachments(question, documents), question, tuple(documents))
    raise _bad("content must be a string or a list of text and file parts", param, "invalid_type")


def _file_part(part: dict, param: str) -> Document:
    """A file content part as OpenAI's API sends it, converted to a document; a bad one is a 400."""
    file = part.get("file")
    data_url = file.get("file_data") if isinstance(file, dict) else None
    if not isinstance(file, dict) or not isinstance(data_url, str) or not data_url.startswith("data:") \
            or ";base64," not in data_url:
        raise _bad("a file part needs file.file_data as a data URL (\"data:<mime>;base64,...\"); file_id is not "
                   "supported (this server stores no uploaded files)", param, "unsupported_value")
    filename = file.get("filename")
    if filename is not None and not isinstance(filename, str):
        raise _bad("file.filename must be a string", param, "invalid_type")
    encoded = data_url.split(";base64,", 1)[1]
    if len(encoded) > (MAX_FILE_BYTES + 2) // 3 * 4 + 4:
        raise _bad(f"the file is larger than {MAX_FILE_BYTES // 2**20} MB, the most an attachment may be", param,
                   "file_too_large")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("file.file_data is not valid base64", param) from None
    try:
        return convert_bytes(filename or "attachment", data)
    except DocumentError as error:
        raise _bad(str(error), param, "invalid_file") from None


def _messages(value, sampling: SamplingConfig) -> Conversation:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects", "messages")
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    documents: list[tuple[Document, ...]] = []
    questions: list[str] = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad("each message must be an object with a role and a content", f"messages[{index}]")
        role = message.get("role")
        if role in ("tool", "function"):
            raise _bad(f"role {role!r} is not supported: this server has no tools", f"messages[{index}].role",
                       "unsupported_value")
        if role not in SYSTEM_ROLES + CHAT_ROLES:
            raise _bad(f"unknown role {role!r}: use system, user or assistant", f"messages[{index}].role")
        content = _content(message, index)
        if role in SYSTEM_ROLES:
            if turns:
                raise _bad("system messages are accepted only at the start of the conversation",
                           f"messages[{index}].role", "unsupported_value")
            system.append(content.text)
        else:
            turns.append((role, content.text))
            documents.append(content.documents)
            questions.append(content.question)
    return Conversation("\n\n".join(system), tuple(turns), sampling, tuple(documents), tuple(questions))


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _bad(f"{name} must be a number", name, "invalid_type")
    if value < low or value > high or (low_open and value == low):
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise _bad(f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer", name, "invalid_type")
    if value < low:
        raise _bad(f"{name} must be at least {low}, got {value}", name)
    if value > high:
        raise _bad(f"{name} must be at most {high}, got {value}", name)
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise _bad("stop must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise _bad("n must be 1: one reply per request", "n", "unsupported_value")
    for name in ("tools", "functions"):
        if body.get(name):
            raise _bad(f"{name} are not supported: this server has no tools", name, "unsupported_value")
    if body.get("logprobs"):
        raise _bad("logprobs are not supported", "logprobs", "unsupported_value")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _bad("only the text response format is supported", "response_format", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2, 2) not in (None, 0.0):
            raise _bad(f"{name} is not supported (only 0)", name, "unsupported_value")


def _check_body(body, model_id: str) -> None:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"the model {model!r} is not served here; this server runs {model_id!r}", "model",
                       "model_not_found")


def parse_chat_request(body, model_id: str, defaults: SamplingConfig) -> ChatRequest:
    """Check a POST /v1/chat/completions body; what it leaves out comes from `defaults` (the app's settings)."""
    _check_body(body, model_id)
    conversation = _messages(body.get("messages"), defaults)
    _refuse_unsupported(body)
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise _bad("stream must be true or false", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or options.get("include_usage") not in (None, True, False):
        raise _bad("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    limit = _integer(body, "max_completion_tokens", 1, MAX_TOKENS_BOUND)
    limit = _integer(body, "max_tokens", 1, MAX_TOKENS_BOUND) if limit is None else limit
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    seed = _integer(body, "seed", *SEED_BOUNDS)
    try:
        sampling = replace(
            defaults,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            max_new_tokens=defaults.max_new_tokens if limit is None else limit,
            stop_strings=_stop(body.get("stop")),
            seed=seed,
        )
    except ConfigError as error:  # a combination the sampler refuses
        raise _bad(str(error), None) from None
    return ChatRequest(replace(conversation, sampling=sampling), bool(stream), bool(options.get("include_usage")))


@dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize as vLLM takes it: a chat (`messages`, templated as a turn templates them, with the reply's
    opening unless add_generation_prompt is false) or a bare text (`prompt`)."""

    conversation: Conversation | None
    prompt: str | None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # for a bare text: the tokenizer's own (BOS...) around it


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false", name, "invalid_type")
    return value


def parse_tokenize_request(body, model_id: str) -> TokenizeRequest:
    """Check a POST /tokenize body (vLLM's shape); attached files in `messages` are converted, as in a chat."""
    _check_body(body, model_id)
    if ("messages" in body) == ("prompt" in body):
        raise _bad("give either messages (a chat, templated) or prompt (a text), not both", None)
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise _bad("prompt must be a string", "prompt", "invalid_type")
        return TokenizeRequest(None, body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))
    for name in ("continue_final_message", "add_special_tokens"):
        if _flag(body, name, False):
            raise _bad(f"{name} is not supported for messages: the chat template places the special tokens",
                       name, "unsupported_value")
    return TokenizeRequest(_messages(body.get("messages"), SamplingConfig()), None,
                           _flag(body, "add_generation_prompt", True))
