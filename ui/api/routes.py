"""The API's routes: GET /v1/models, POST /v1/chat/completions and POST /tokenize (vLLM's, beside /v1), to be
handed to the Gradio app's FastAPI constructor (so they exist from the start).

    demo.launch(app_kwargs={"routes": api_routes(service, ApiOptions(key="secret"))})

Each route only connects: the request is checked (protocol.py, off the event loop: attached files are
converted there), the turn runs in the service (serving.py), and the reply goes back in OpenAI's shapes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.routing import BaseRoute

from chat_service import ChatService

from . import serving
from .protocol import ApiError, parse_chat_request, parse_tokenize_request


@dataclass(frozen=True)
class ApiOptions:
    key: str | None = None  # a bearer token every request must carry; None: no key
    max_waiting: int = 4  # requests that may wait for their turn; one more gets 429


def api_routes(service: ChatService, options: ApiOptions) -> list[BaseRoute]:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models(request: Request):
        try:
            serving.check_key(request, options.key)
            model_id = await asyncio.to_thread(serving.served_model, service)  # a remote one may be asked
        except ApiError as error:
            return serving.error_response(error)
        entry = {"id": model_id, "object": "model", "created": int(service.host.loaded_at), "owned_by": "infinigen-chat"}
        window = serving.served_window(service)
        if window:  # as vLLM says it: a front app in remote mode reads it (chat_service/backend_client.py)
            entry["max_model_len"] = window
        return {"object": "list", "data": [entry]}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            serving.check_key(request, options.key)
            body = await serving.json_body(request)
            model_id = await asyncio.to_thread(serving.served_model, service)  # a remote one may be asked
            # converting an attached PDF or DOCX takes seconds: never on the event loop, which serves the page too
            chat_request = await asyncio.to_thread(parse_chat_request, body, model_id,
                                                   service.settings.current.sampling)
            # a file longer than the window is read by passages (indexed once per file: seconds, off the loop too)
            chat_request, documents = await asyncio.to_thread(serving.with_documents_read, service, chat_request)
            prompt_ids = await asyncio.to_thread(serving.checked_prompt_ids, service, chat_request)
        except ApiError as error:
            return serving.error_response(error)
        job = serving.Generation(service, chat_request, prompt_ids, options.max_waiting)
        try:
            first = await job.next_item_while_connected(request)
        except ApiError as error:
            return serving.error_response(error)
        reply = serving.Reply(model_id, len(prompt_ids), job.turn, documents)
        if chat_request.stream:
            return StreamingResponse(reply.stream(job, first, chat_request.include_usage),
                                     media_type="text/event-stream", headers=reply.headers())
        try:
            await reply.collect(job, first, request)
        except ApiError as error:
            return serving.error_response(error)
        return JSONResponse(reply.completion(), headers=reply.headers())

    @router.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's shape, where vLLM serves it: a front app (--backend) counts its window with it."""
        try:
            serving.check_key(request, options.key)
            body = await serving.json_body(request)
            serving.require_local_tokenizer(service)  # before asking a backend for its model name
            model_id = await asyncio.to_thread(serving.served_model, service)
            asked = await asyncio.to_thread(parse_tokenize_request, body, model_id)  # files are converted
            return await asyncio.to_thread(serving.tokenize, service, asked)
        except ApiError as error:
            return serving.error_response(error)

    return list(router.routes)
