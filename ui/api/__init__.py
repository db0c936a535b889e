"""The OpenAI-compatible API beside the page: GET /v1/models and POST /v1/chat/completions.

    demo.launch(app_kwargs={"routes": api_routes(service, ApiOptions(key="secret"))})

Replies come from the same service (chat_service/), engine and sessions as the page, one turn at a time: a request
waits its turn (or gets 429 when `max_waiting` requests already wait) and is stored as an API session, so
a conversation that comes back longer continues from its KV on disk.

protocol: the request body checked into a ChatRequest (or an ApiError with OpenAI's fields); serving: the
checks, the worker thread and the reply's shapes; routes: the FastAPI routes. Which stored session a request
continues, and its turn, are the service's (chat_service/api_turns.py).
"""

from .protocol import ApiError, ChatRequest, parse_chat_request
from .routes import ApiOptions, api_routes

__all__ = ["ApiError", "ApiOptions", "ChatRequest", "api_routes", "parse_chat_request"]
