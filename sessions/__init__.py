"""Sessions that survive: conversations in SQLite, their KV pools as safetensors chunks beside it.

    from sessions import SessionStore, ChatSession
    store = SessionStore()                       # or SessionStore("/path/to/data", StorageConfig(kv_format="exact"))
    chat = ChatSession.open(store, engine, store.create("Notes"))
"""

from .chat import ChatSession, RestoreReport, WindowCheck
from .errors import (
    ContextWindowError,
    ImportValidationError,
    SessionError,
    SessionLockedError,
    SessionNotFoundError,
)
from .paths import default_data_dir
from .storage import StorageConfig, format_size, parse_size
from .store import Message, SessionStore, SessionSummary

__all__ = [
    "ChatSession", "ContextWindowError", "ImportValidationError", "Message", "RestoreReport", "SessionError",
    "SessionLockedError", "SessionNotFoundError", "SessionStore", "SessionSummary", "StorageConfig", "WindowCheck",
    "default_data_dir", "format_size", "parse_size",
]
