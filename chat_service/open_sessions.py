"""The sessions open in this process (the page's and the API's latest) and the one whose KV the engine holds.

The engine holds one conversation at a time: before a turn, `hold` reads its session's KV back from disk
when another session used the engine since. A session is closed (its lock released) once neither the page
nor the API has it open.
"""

from __future__ import annotations

from collections.abc import Callable

from sessions import ChatSession, SessionStore
from sessions.prefix import PrefixFinder

from .model_host import ModelHost
from .remote_chat import OpenChat

Progress = Callable[[int, int], None]


class OpenSessions:
    def __init__(self, store: SessionStore, host: ModelHost) -> None:
        self.store, self.host = store, host
        self.page: OpenChat | None = None  # the session the page shows
        self.api: OpenChat | None = None  # the API's latest conversation, kept open for the next request
        self.holder: OpenChat | None = None  # the session whose KV the engine holds now
        self.prefixes = PrefixFinder(store)

    def start_from_stored_prefix(self, chat: OpenChat, prompt_ids: list[int]) -> int:
        """Before a new session's first turn (the page's or the API's): take the longest stored token prefix
        of `prompt_ids` that another session's chunks hold (an attached document read in an earlier chat, the
        same system prompt), so the model reads only the rest. Shares whole chunks (the same files, no copy)
        and reads the rows of a partly matching one. `chat` must hold no tokens yet and be the engine's
        holder. Returns the tokens taken."""
        engine = self.host.engine
        if not isinstance(chat, ChatSession) or engine is None:  # a remote server generates, and holds the KV
            return 0
        if engine.num_tokens or self.store.chunks(chat.id):
            return 0
        match = self.prefixes.longest(engine.kv_signature(), prompt_ids)
        if not match.tokens or match.session_id == chat.id:
            return 0
        shared = self.store.share_chunks(match.session_id, chat.id, match.tokens)
        if shared:
            chat.reload()  # reads the shared chunks into the engine
        rest = [record for record in match.chunks if record.end > shared]
        # reading a chunk is far cheaper per token than computing it, but not free: only for a good share of it
        if rest and (match.tokens - rest[0].start) * 4 >= rest[0].end - rest[0].start:
            shared += chat.import_prefix(rest[0], match.tokens)
        return shared

    def open(self, session_id: str, progress: Progress | None = None) -> OpenChat:
        """Open a session, which restores its KV into the engine (whatever the engine held is gone)."""
        self.holder = None
        chat = self.host.open_chat(self.store, session_id, progress)
        self.holder = chat
        return chat

    def hold(self, chat: OpenChat, progress: Progress | None = None) -> None:
        """Make the engine hold `chat`'s KV: read it back from disk if another session used the engine since."""
        if self.holder is not chat:
            self.holder = None
            chat.reload(progress)
            self.holder = chat

    def release(self, chat: OpenChat | None) -> None:
        """Close a session that neither the page nor the API has open any more."""
        if chat is not None and chat is not self.page and chat is not self.api:
            if self.holder is chat:
                self.holder = None
            chat.close()

    def for_api(self, session_id: str) -> OpenChat:
        """`session_id` open for the API (shared with the page when it has it open), its KV in the engine."""
        for chat in (self.api, self.page):
            if chat is not None and chat.id == session_id:
                break
        else:
            chat = self.open(session_id)
        previous, self.api = self.api, chat
        self.release(previous)
        self.hold(chat)
        return chat

    def close_all(self) -> None:
        """Before the engine goes: every open session holds it (the API's too)."""
        for chat in {id(chat): chat for chat in (self.page, self.api) if chat is not None}.values():
            chat.close()
        self.page = self.api = self.holder = None
