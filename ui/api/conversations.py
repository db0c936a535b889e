"""The API's turns: which stored session a request continues (or which one's chunks a new one shares), and
the turn itself, one at a time with the page.

    turn = ApiTurn()
    for event in conversations.answer(system, turns, prompt_ids, sampling, cancel, turn, max_waiting): ...
    turn.session_id, turn.continued, turn.prefilled_tokens
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from documents import Document
from infinigen_core import ConfigError, ContextOverflowError, GenerationEvent, SamplingConfig
from sessions import ChatSession, SessionError, SessionLockedError, SessionStore

from ..errors import UserError
from ..model_host import ModelHost
from ..open_sessions import OpenSessions
from ..settings import SettingsKeeper
from ..turns import EitherSet, TurnRunner

Turns = list[tuple[str, str]]
_ATTACHED_NAME = re.compile(r'<document name="([^"]*)"')


@dataclass
class ApiTurn:
    """What an API request ran as: filled in while its turn runs, read by the API for headers and usage."""

    session_id: str = ""
    continued: bool = False  # True: it extended a stored API conversation; False: a new session
    prefilled_tokens: int = 0  # tokens of the prompt that the model actually read (re-read on reopening too)
    reread_tokens: int = 0  # of those, what reopening the session re-read (its KV chunks were not on disk)


class ApiConversations:
    def __init__(self, store: SessionStore, host: ModelHost, settings: SettingsKeeper, turns: TurnRunner,
                 open_sessions: OpenSessions) -> None:
        self.store, self.host, self.settings, self.turns, self.open = store, host, settings, turns, open_sessions
        self.turns_run = 0  # API turns run, so the page knows to refresh its session list

    def answer(self, system: str, turns: Turns, prompt_ids: list[int], sampling: SamplingConfig,
               cancel: threading.Event, turn: ApiTurn, max_waiting: int,
               documents: Sequence[tuple[Document, ...]] = ()) -> Iterator[GenerationEvent]:
        """Answer an API request's conversation (system prompt, then (role, content) turns, templated into
        `prompt_ids`), one turn at a time with the page. It extends the stored API conversation it continues,
        or starts a new API session that shares the longest stored token prefix's chunks. Raises QueueFull
        when `max_waiting` requests already wait, Abandoned when `cancel` is set before the turn comes.
        `documents`, per turn, are the files attached to it: stored as its attachment records (cards)."""
        self.host.require_engine()
        with self.turns.queued(cancel, max_waiting):  # only this client going away ends the wait
            try:
                self.turns.cancel.clear()  # a Stop pressed before this turn is not meant for it
                either = EitherSet(cancel, self.turns.cancel)  # from now on the page's Stop button stops it too
                # the turn runs in the model's thread (engine_thread.py); its events come here as they come
                turn_events = self._turn(system, turns, prompt_ids, sampling, either, turn, documents)
                for events in self.turns.model_thread.paced(turn_events, 0, cancel.set):
                    yield from events
            except (SessionError, ContextOverflowError, ConfigError) as error:
                raise UserError(str(error)) from None
            finally:
                self.turns.idle()
                self.turns_run += 1

    def _turn(self, system: str, turns: Turns, prompt_ids: list[int], sampling: SamplingConfig, cancel: EitherSet,
              turn: ApiTurn, documents: Sequence[tuple[Document, ...]]) -> Iterator[GenerationEvent]:
        chat, new_turns = self._session(system, turns, prompt_ids, turn)
        self.settings.apply_pending(self.host.engine, self.store, chat.id)
        on_progress = self.turns.start("prefill")

        def on_prefill(done: int, total: int) -> None:
            on_progress(done, total)
            turn.prefilled_tokens = turn.reread_tokens + total

        attached = tuple(documents)[len(turns) - len(new_turns):] if documents else ()
        yield from self.turns.track(chat.extend(new_turns, sampling, cancel, on_prefill, attached))

    def _session(self, system: str, turns: Turns, prompt_ids: list[int],
                 turn: ApiTurn) -> tuple[ChatSession, Turns]:
        """The session to answer in (its KV in the engine) and the turns it does not hold yet."""
        for summary in self.store.list():  # most recent first
            if summary.origin != "api" or summary.system_prompt != system or summary.message_count > len(turns):
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
        chat = self._new_session(system, turns, prompt_ids)
        turn.session_id, turn.continued = chat.id, False
        return chat, turns

    def _new_session(self, system: str, turns: Turns, prompt_ids: list[int]) -> ChatSession:
        """A new API session that starts from the longest stored token prefix's chunks, when worth reading."""
        engine = self.host.engine
        title = next((content for role, content in turns if role == "user" and content.strip()), "API chat")
        attached = _ATTACHED_NAME.match(title)  # a message about a file: named after it, not after its tag
        title = f"About {attached.group(1)}" if attached else title
        session_id = self.store.create(title.strip().splitlines()[0][:60], system, self.settings.record(),
                                       engine.fingerprint, origin="api")
        try:
            chat = self.open.for_api(session_id)
        except BaseException:
            self.store.delete(session_id)  # nothing half-made is left in the sidebar
            raise
        self.open.start_from_stored_prefix(chat, prompt_ids)
        return chat
