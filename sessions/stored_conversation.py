"""The conversation an open session keeps in the store, as both kinds of open session read it: the local
engine's (ChatSession, chat.py) and a remote server's (chat_service/remote_chat.py).

    class MySession(StoredConversation):
        def __init__(self, store, session_id): self.store, self.id = store, session_id
    MySession(store, session_id)._conversation(extra_user="Hi")   # [{"role": "system", ...}, ..., {"role": "user", ...}]

Each kind counts its window its own way (`check_window`); the rule that drops whole turns to fit it is one
(`fit_window`, sessions/overflow.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from documents.fitting import with_sources

from .errors import ContextWindowError, SessionError
from .overflow import turns_kept
from .store import Message, SessionStore

if TYPE_CHECKING:
    from .chat import WindowCheck


def with_sources_kept(kept: list[Message], before: Sequence[Message]) -> list[Message]:
    """`kept` (what a cut of `before` leaves) with each reference to a file's text ("[The same text as attached
    above.]", documents.fitting.read_above) whose text went with a dropped turn made that text again, in the first
    kept message that refers to it (later ones refer to that one): the model is never left with a pointer to
    nothing. The rest unchanged."""
    sources = [(m.content, m.attachments) for m in before if m.attachments]
    mended: list[Message] = []
    for message in kept:
        # where read_above looks for a file's text (chat_service.document_reading): the user messages with files
        attached_above = [m.content for m in mended if m.role == "user" and m.attachments]
        content, records = with_sources(message.content, message.attachments, attached_above, sources)
        changed = content != message.content
        mended.append(dataclasses.replace(message, content=content, attachments=records) if changed else message)
    return mended


def conversation(system: str, turns: list[tuple[str, str]]) -> list[dict]:
    """(role, content) turns after the system prompt (when there is one), as the chat template takes them."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": role, "content": content} for role, content in turns]


class StoredConversation:
    """Its messages and system prompt, read from the store each time (another window may have changed them), and
    the turn list a chat template (or an OpenAI-compatible server) takes."""

    store: SessionStore
    id: str

    @property
    def messages(self) -> list[Message]:
        return self.store.messages(self.id)

    @property
    def system_prompt(self) -> str:
        return self.store.get(self.id).system_prompt

    def set_system_prompt(self, text: str) -> None:
        self.store.update(self.id, system_prompt=text)  # whatever holds the KV follows at the next turn

    def _conversation(self, messages: list[Message] | None = None, extra_user: str | None = None) -> list[dict]:
        """The turns of `messages` (all stored ones by default) after the system prompt, then `extra_user` as a
        user turn when given."""
        history = self.messages if messages is None else messages
        turns = conversation(self.system_prompt, [(m.role, m.content) for m in history])
        if extra_user is not None:
            turns.append({"role": "user", "content": extra_user})
        return turns

    def check_window(self, text: str = "", messages: list[Message] | None = None) -> WindowCheck:
        """Whether a user message `text` after `messages` (all stored ones by default) and a short reply fit the
        model's window, as this kind of session counts it."""
        raise NotImplementedError

    def drop_oldest_turns(self, text: str = "") -> int:
        """Forget the oldest turns (never the system prompt) until `text` fits; returns how many went."""
        return sum(1 for message in self.fit_window(text) if message.role == "user")

    def fit_window(self, text: str = "", keep_first: bool = False) -> list[Message]:
        """Forget the fewest whole turns (never the system prompt, nor the last turn) until `text` fits: the
        oldest, or with `keep_first` those after the first turn (sessions/overflow.py). Returns the messages
        that went; raises ContextWindowError when no such choice fits. A file attached again in a kept message
        (a reference to a dropped turn's text) gets its text back there (`with_sources_kept`), counted in the
        fit. Only stored messages change (their token spans become unknown): the next turn reads the
        conversation from where it changed, so the model never attends to a dropped token."""
        before = self.messages
        cut = turns_kept(before, lambda messages: self.check_window(text, messages).fits, keep_first,
                         lambda kept: with_sources_kept(kept, before))
        if cut is None:
            raise ContextWindowError(self.check_window(text, before))
        if cut.dropped:
            self.store.replace_messages(self.id, [(m.role, m.content, m.attachments) for m in cut.kept])
        return cut.dropped

    def _last_user_message(self, messages: list[Message], missing: str) -> Message:
        """The last user message of `messages` (what regenerate and edit act on); SessionError(`missing`) when
        there is none."""
        users = [m for m in messages if m.role == "user"]
        if not users:
            raise SessionError(missing)
        return users[-1]
