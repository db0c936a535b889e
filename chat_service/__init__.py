"""What the app does, without Gradio: the model, the settings, the open sessions and the turns, shared by its
two faces, the page (ui/) and the OpenAI-compatible API (ui/api/).

service: ChatService, the composition root that builds the parts once; model_host: the model (load, switch,
device, memory); settings: engine, sampling and KV storage settings; turns: one generation at a time (lock,
API queue, Stop, progress) and the one turn runner both faces use; engine_thread: the one thread the model
runs in; open_sessions: whose KV the engine holds; page_sessions and page_turns: the page's session actions
and turns; api_turns: the API's turns; errors: the user-facing failures. With `--backend URL` a remote
OpenAI-compatible server generates instead of the local engine: remote_host stands in for model_host,
remote_chat for the engine-bound session, backend_client is the HTTP client.

Imports nothing from ui/ and nothing of Gradio.
"""

from .errors import BUSY, Abandoned, QueueFull, UserError
from .service import ChatService

__all__ = ["BUSY", "Abandoned", "ChatService", "QueueFull", "UserError"]
