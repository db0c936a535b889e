"""A stored session whose replies come from a remote OpenAI-compatible server (backend_client.py): the same
conversation actions as ChatSession (sessions/chat.py), which the page and the API call alike, with the
messages stored here and the KV held by the server (its prefix cache, or LMCache), never on this disk.

    chat = RemoteChat.open(store, client, session_id)
    for event in chat.send("Hello", SamplingConfig(max_new_tokens=200), cancel): print(event.text, end="")

Nothing is stored before the server has accepted the request: a bad URL, a wrong key or model, or a prompt
over the server's window leaves the session as it was. Where the server serves a tokenizer (backend_tokens.py)
a prompt over its window is refused here first, in the local engine's words, and the session's token count
(the sidebar's) is the server's count of the stored conversation; elsewhere that count is each reply's usage. Once accepted, the user's turns are stored, and the
reply as it streams (also when stopped, or when the server goes away mid-reply). Its messages carry no token
spans (0, 0) and the session no KV chunks, so the local engine re-reads the conversation when it opens it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from documents import Document, attachment_record, message_with_attachments
from infinigen_core import GenerationEvent, SamplingConfig
from sessions import ChatSession, ContextWindowError, RestoreReport, SessionError, SessionStore
from sessions.chat import REPLY_SAVE_SECONDS, NewMessage, WindowCheck
from sessions.lock import SessionLock, session_lock
from sessions.store import Message
from sessions.stored_conversation import StoredConversation

from .backend_client import BackendClient, BackendError, TurnFigures
from .backend_tokens import BackendTokens

Progress = Callable[[int, int], None]
FINISH = {"stop": "eos", "length": "length"}  # the server's finish reasons as the app's events say them
NOT_READ = RestoreReport(0, 0, 0.0, False, "")  # the server holds the KV: opening reads nothing here


def _users(messages: list[Message]) -> int:
    return sum(1 for m in messages if m.role == "user")


class RemoteChat(StoredConversation):
    def __init__(self, store: SessionStore, client: BackendClient, session_id: str, lock: SessionLock,
                 tokens: BackendTokens | None = None) -> None:
        self.store, self.client, self.id, self._lock = store, client, session_id, lock
        self.tokens = tokens or BackendTokens(client)
        self.restore = NOT_READ
        self.last_read_tokens = 0

    @classmethod
    def open(cls, store: SessionStore, client: BackendClient, session_id: str,
             tokens: BackendTokens | None = None) -> RemoteChat:
        store.get(session_id)  # a clear error for an unknown id
        lock = session_lock(store.data_dir, session_id).acquire()
        try:
            store.touch(session_id)
        except BaseException:
            lock.release()
            raise
        return cls(store, client, session_id, lock, tokens)

    def close(self) -> None:
        self._lock.release()

    def reload(self, progress: Progress | None = None) -> RestoreReport:
        return NOT_READ

    # ------------------------------------------------------------------ the window, counted by the server
    def check_window(self, text: str = "", messages: list[Message] | None = None) -> WindowCheck:
        """Whether a user message `text` after `messages` (all stored ones by default) and a short reply fit the
        server model's window, counted by the server's tokenizer (fits when it has none: BackendTokens)."""
        history = self.messages if messages is None else messages
        return self.tokens.window_check(self._conversation(history, text), _users(history))

    def _require_fits(self, turns: list[dict], earlier: list[Message], attached: bool = False) -> None:
        check = self.tokens.window_check(turns, _users(earlier))
        if not check.fits:
            raise ContextWindowError(check, attached)

    def fit_window(self, text: str = "", keep_first: bool = False) -> list[Message]:
        """StoredConversation's rule, counted by the server; only stored messages go (the server's prefix cache
        lets the old prefix age out). SessionError when the server counts nothing, so no turn can be chosen."""
        check = self.check_window(text)
        if not (check.window and check.needed_tokens):  # the server told no window, or counted nothing
            raise SessionError("the backend tells no token counts or no window (it serves no /tokenize of a known "
                               "shape), so the app cannot tell which turns to drop: start a new session (or branch "
                               "from a later message)")
        return super().fit_window(text, keep_first)

    def prompt_ids(self, text: str) -> list[int]:
        return []  # no local tokenizer: a new remote session never starts from stored KV chunks

    def user_message(self, text: str, attachments: Sequence[Document] = ()) -> tuple[str, list[dict]]:
        return message_with_attachments(text.strip(), attachments), [attachment_record(d) for d in attachments]

    # ------------------------------------------------------------------ turns (ChatSession's, remotely)
    def send(self, text: str, sampling: SamplingConfig = SamplingConfig(), cancel=None,
             on_prefill_progress: Progress | None = None,
             attachments: Sequence[Document] = ()) -> Iterator[GenerationEvent]:
        content, records = self.user_message(text, attachments)
        if not content:
            raise SessionError("the message is empty: type something first")
        history = self.messages
        turns = self._conversation(history, extra_user=content)
        self._require_fits(turns, history, attached=bool(attachments))
        yield from self._reply(turns, [NewMessage("user", content, 0, 0, records)], sampling, cancel)

    def extend(self, turns: list[tuple[str, str]], sampling: SamplingConfig = SamplingConfig(), cancel=None,
               on_prefill_progress: Progress | None = None,
               documents: Sequence[Sequence[Document]] = ()) -> Iterator[GenerationEvent]:
        new = []
        for index, (role, content) in enumerate(turns):
            if role not in ("user", "assistant"):
                raise SessionError(f"a stored message is from the user or the assistant, not {role!r}")
            attached = [attachment_record(d) for d in documents[index]] if index < len(documents) else []
            new.append(NewMessage(role, content, 0, 0, attached))
        history = self.messages
        asked = self._conversation(history) + [{"role": m.role, "content": m.content} for m in new]
        self._require_fits(asked, history)
        yield from self._reply(asked, new, sampling, cancel)

    def regenerate(self, sampling: SamplingConfig = SamplingConfig(), cancel=None,
                   on_prefill_progress: Progress | None = None) -> Iterator[GenerationEvent]:
        messages = self.messages
        last_user = self._last_user_message(messages, "there is no message to answer yet")
        kept = [m for m in messages if m.position <= last_user.position]
        yield from self._reply(self._conversation(kept), [], sampling, cancel, replaces_from=last_user.position + 1)

    def edit_last_user(self, text: str, sampling: SamplingConfig = SamplingConfig(), cancel=None,
                       on_prefill_progress: Progress | None = None) -> Iterator[GenerationEvent]:
        if not text.strip():
            raise SessionError("the edited message is empty: type something first")
        last_user = self._last_user_message(self.messages, "there is no message to edit yet")
        kept = [m for m in self.messages if m.position < last_user.position]
        turns = self._conversation(kept, extra_user=text.strip())
        self._require_fits(turns, kept)
        # the old message and its reply go only once the server has taken the new one
        yield from self._reply(turns, [NewMessage("user", text.strip(), 0, 0, [])], sampling, cancel,
                               replaces_from=last_user.position)

    def _reply(self, turns: list[dict], new: list[NewMessage], sampling: SamplingConfig, cancel,
               replaces_from: int | None = None) -> Iterator[GenerationEvent]:
        """Ask the server for a reply to `turns`; once it answers, store `new` (replacing the messages from
        `replaces_from` on), then the reply as it streams, and what came of it whatever ends it. A refusal, or a
        failure before the first piece, stores nothing."""
        text, reply_id, saved_at, finish = "", None, 0.0, None
        stored = False

        def store_turns() -> None:
            nonlocal stored
            if not stored and new:
                if replaces_from is not None:
                    self.store.delete_messages_from(self.id, replaces_from)
                self.store.add_messages(self.id, [message.row() for message in new])
            stored = True

        figures: TurnFigures | None = None
        try:
            with self.client.reply(turns, sampling) as stream:  # BackendError here: nothing stored
                figures = stream.figures
                try:
                    for piece in stream.pieces(cancel):
                        store_turns()
                        text += piece.text
                        finish = piece.finish_reason or finish
                        if reply_id is None and piece.text:
                            reply_id, saved_at = self._start_reply(text, replaces_from if not new else None), time.monotonic()
                        elif reply_id is not None and time.monotonic() - saved_at >= REPLY_SAVE_SECONDS:
                            self.store.update_message(reply_id, text, 0)
                            saved_at = time.monotonic()
                        if piece.text:
                            yield GenerationEvent(None, piece.text, text, None)
                    store_turns()  # ended or stopped before a piece came: the turn is kept, as the engine keeps it
                finally:  # stopped, failed or done: keep what came
                    if reply_id is not None:
                        self.store.update_message(reply_id, text, 0)
                    self.last_read_tokens = stream.figures.prompt_tokens or 0
        finally:  # once the upstream request is closed
            if stored and figures is not None:
                self._count_tokens(figures)
        stopped = cancel is not None and cancel.is_set()
        yield GenerationEvent(None, "", text, None, "cancelled" if stopped else FINISH.get(finish or "stop", "eos"))

    def _count_tokens(self, figures: TurnFigures) -> None:
        """The session's token count (the sidebar's): the stored conversation counted by the server's tokenizer,
        else the reply's usage (its prompt and reply), else left as it was."""
        try:
            counted = self.tokens.count(self._conversation(), for_reply=False)
        except BackendError:  # the server went away mid-reply: what its usage said, if it said it
            counted = None
        if counted is None and figures.prompt_tokens is not None:
            completion = figures.completion_tokens if figures.completion_tokens is not None else figures.pieces
            counted = figures.prompt_tokens + completion
        if counted:
            self.store.update(self.id, token_count=counted)

    def _start_reply(self, text: str, replaces_from: int | None) -> int:
        if replaces_from is not None:  # a regenerated reply: the old one goes once the new one has begun
            self.store.delete_messages_from(self.id, replaces_from)
        self.store.add_message(self.id, "assistant", text, 0, 0)
        return self.store.messages(self.id)[-1].id


# a session open for turns: bound to the local engine, or to a remote server
OpenChat = ChatSession | RemoteChat
