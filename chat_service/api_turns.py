"""The API's turns: which stored session a request continues (or which one's chunks a new one shares), and
the turn itself, through the same turn runner as the page's.

    turn = ApiTurn()
    for event in api.answer(request, prompt_ids, cancel, turn, max_waiting): ...
    turn.session_id, turn.continued, turn.prefilled_tokens
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from documents import Document
from infinigen_core import GenerationEvent, SamplingConfig
from sessions import SessionLockedError, SessionStore

from .backend_client import TurnFigures
from .errors import UserError
from .model_host import ModelHost
from .open_sessions import OpenSessions
from .remote_chat import OpenChat
from .settings import SettingsKeeper
from .titles import session_title
from .turns import EitherSet, Progress, TurnRunner

Turns = list[tuple[str, str]]


@dataclass(frozen=True)
class Conversation:
    """What an API request asks to answer: the system prompt, then (role, content) turns, with the files
    attached to each turn (their text is in its content) and the question each user turn asked."""

    system: str
    turns: tuple[tuple[str, str], ...]
    sampling: SamplingConfig
    documents: tuple[tuple[Document, ...], ...] = ()  # per turn
    questions: tuple[str, ...] = ()  # per turn: its text without the attached files' (for the title)


@dataclass
class ApiTurn:
    """What an API request ran as: filled in while its turn runs, read by the API for headers and usage."""

    session_id: str = ""
    continued: bool = False  # True: it extended a stored API conversation; False: a new session
    prefilled_tokens: int = 0  # tokens of the prompt that the model actually read (re-read on reopening too)
    reread_tokens: int = 0  # of those, what reopening the session re-read (its KV chunks were not on disk)
    figures: TurnFigures | None = None  # what a remote server told about the reply (its usage)


class ApiTurns:
    def __init__(self, store: SessionStore, host: ModelHost, settings: SettingsKeeper, turns: TurnRunner,
                 open_sessions: OpenSessions) -> None:
        self.store, self.host, self.settings, self.turns, self.open = store, host, settings, turns, open_sessions
        self.turns_run = 0  # API turns run, so the page knows to refresh its session list

    def answer(self, asked: Conversation, prompt_ids: list[int], cancel: threading.Event, turn: ApiTurn,
               max_waiting: int) -> Iterator[GenerationEvent]:
        """Answer an API request's conversation (templated into `prompt_ids`), one turn at a time with the page.
        It extends the stored API conversation it continues, or starts a new API session that shares the
        longest stored token prefix's chunks. Raises QueueFull when `max_waiting` requests already wait,
        Abandoned when `cancel` is set before the turn comes, UserError when the turn fails."""
        self.host.require_ready()
        turns = list(asked.turns)
        new_turns: Turns = []

        def session_of_turn() -> OpenChat:
            chat, rest = self._session(asked, turns, prompt_ids, turn)
            new_turns.extend(rest)
            return chat

        def generate(chat: OpenChat, progress: Progress) -> Iterator[GenerationEvent]:
            def on_prefill(done: int, total: int) -> None:
                progress(done, total)
                turn.prefilled_tokens = turn.reread_tokens + total

            attached = asked.documents[len(turns) - len(new_turns):] if asked.documents else ()
            either = EitherSet(cancel, self.turns.cancel)  # the page's Stop button stops it too
            return chat.extend(new_turns, asked.sampling, either, on_prefill, attached)

        with self.turns.queued(cancel, max_waiting):  # only this client going away ends the wait
            try:
                for events in self.turns.run(session_of_turn, generate, 0, cancel.set):
                    yield from events
                turn.figures = self.host.turn_figures()
            except UserError:
                self._forget_if_empty(turn)
                raise
            finally:
                self.turns_run += 1

    def _forget_if_empty(self, turn: ApiTurn) -> None:
        """A new session whose first turn failed before anything was stored (a remote server refused it) is not
        left empty in the sidebar."""
        chat = self.open.api
        if turn.continued or chat is None or chat.id != turn.session_id or chat is self.open.page or chat.messages:
            return
        self.open.api = None
        self.open.release(chat)
        self.store.delete(chat.id)

    def _session(self, asked: Conversation, turns: Turns, prompt_ids: list[int],
                 turn: ApiTurn) -> tuple[OpenChat, Turns]:
        """The session to answer in (its KV in the engine) and the turns it does not hold yet."""
        for summary in self.store.list():  # most recent first
            if summary.origin != "api" or summary.system_prompt != asked.system or summary.message_count > len(turns):
                continue
            stored = [(m.role, m.content) for m in self.store.messages(summary.id)]
            if stored != turns[: len(stored)]:
                continue
            restored = [(open_chat, open_chat.restore) for open_chat in (self.open.api, self.open.page) if open_chat]
            try:
                chat = self.open.for_api(summary.id)
            except SessionLockedError:  # another app process has it open: start a new one beside it
                continue
            if not any(open_chat is chat and report is chat.restore for open_chat, report in restored):
                # opened or read back just now: what it recomputed (dropped or unusable chunks) was read, not cached
                turn.reread_tokens = turn.prefilled_tokens = chat.restore.tokens_prefilled
            turn.session_id, turn.continued = chat.id, True
            return chat, turns[len(stored):]
        chat = self._new_session(asked, prompt_ids)
        turn.session_id, turn.continued = chat.id, False
        return chat, turns

    def _new_session(self, asked: Conversation, prompt_ids: list[int]) -> OpenChat:
        """A new API session that starts from the longest stored token prefix's chunks, when worth reading."""
        self.host.require_loaded()
        title = self._title(asked)
        session_id = self.store.create(title, asked.system, self.settings.record(), self.host.fingerprint(),
                                       origin="api")
        try:
            chat = self.open.for_api(session_id)
        except BaseException:
            self.store.delete(session_id)  # nothing half-made is left in the sidebar
            raise
        self.open.start_from_stored_prefix(chat, prompt_ids)
        return chat

    @staticmethod
    def _title(asked: Conversation) -> str:
        """The page's title rule, applied to the first user turn that says something."""
        for index, (role, content) in enumerate(asked.turns):
            documents: Sequence[Document] = asked.documents[index] if index < len(asked.documents) else ()
            question = asked.questions[index] if index < len(asked.questions) else content
            if role == "user" and (question.strip() or documents):
                return session_title(question, documents)
        return "API chat"
