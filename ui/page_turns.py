"""The page's turns: send, regenerate, replace the last message, drop the oldest turns. Each streams the
conversation as the chat display shows it; one runs at a time (another gets UserError(BUSY))."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from infinigen_core import ConfigError, ContextOverflowError, GenerationEvent
from sessions import SessionError

from .errors import UserError
from .page_sessions import PageSessions

StartTurn = Callable[[Callable[[int, int], None]], Iterator[GenerationEvent]]


class PageTurns:
    def __init__(self, pages: PageSessions) -> None:
        self.pages = pages
        self.turns, self.open, self.store, self.settings = pages.turns, pages.open, pages.store, pages.settings

    def send(self, text: str) -> Iterator[list[dict]]:
        if not text or not text.strip():
            raise UserError("The message is empty: type something first.")
        self.pages.require_chat()
        chat = self.open.page
        check = chat.check_window(text)
        if not check.fits:
            raise UserError(
                f"This message would bring the conversation to {check.needed_tokens} tokens, beyond the model's "
                f"window of {check.window}. Start a new session, or press 'Drop oldest turns' "
                f"({check.droppable_turns} can go; the system prompt stays). Nothing was sent."
            )
        if not chat.messages and self.store.get(chat.id).title == "New chat":
            self.store.rename(chat.id, text.strip().splitlines()[0][:60])  # a title worth listing
        yield from self._run(lambda progress: self.open.page.send(text, self._sampling(), self.turns.cancel,
                                                                 progress))

    def regenerate(self) -> Iterator[list[dict]]:
        self.pages.require_chat()
        yield from self._run(lambda progress: self.open.page.regenerate(self._sampling(), self.turns.cancel,
                                                                       progress))

    def edit_last(self, text: str) -> Iterator[list[dict]]:
        if not text or not text.strip():
            raise UserError("The edited message is empty: type something first.")
        self.pages.require_chat()
        yield from self._run(lambda progress: self.open.page.edit_last_user(text, self._sampling(),
                                                                           self.turns.cancel, progress))

    def drop_oldest_turns(self, text: str) -> str:
        self.pages.require_chat()
        with self.turns.exclusive():
            try:
                dropped = self.open.page.drop_oldest_turns(text or "")
            except SessionError as error:
                raise UserError(str(error)) from None
        return f"Dropped the {dropped} oldest turn(s); the system prompt was kept."

    def _sampling(self):
        return self.settings.current.sampling

    def _run(self, start_turn: StartTurn) -> Iterator[list[dict]]:
        with self.turns.exclusive():
            self.turns.cancel.clear()
            self.pages.restore_message = ""  # said once, after opening the session
            chat = self.open.page
            self.open.hold(chat, self.turns.start("restore"))
            self.settings.apply_pending(self.pages.host.engine, self.store, chat.id)
            on_prefill = self.turns.start("prefill")
            try:
                history = None
                for event in self.turns.track(start_turn(on_prefill)):
                    if history is None:  # the turn's first step stores or removes messages: read them after it
                        history = self.pages.chat_history()
                    yield history + [{"role": "assistant", "content": event.full_text}]
            except (SessionError, ContextOverflowError, ConfigError) as error:
                raise UserError(str(error)) from None
            finally:
                self.turns.idle()
        yield self.pages.chat_history()
