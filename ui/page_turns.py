"""The page's turns: send, regenerate, replace the last message, drop the oldest turns. Each streams the
conversation as the chat display shows it; one runs at a time (another gets UserError(BUSY))."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from documents import Document, displayed_message
from infinigen_core import ConfigError, ContextOverflowError, GenerationEvent
from sessions import SessionError

from .errors import UserError
from .page_sessions import PageSessions

# how often the chat display takes the reply's new text while a turn runs: every update is post-processed and
# sent by the server and redrawn by the browser, on the cores the model decodes on. `python -m bench page` on
# the 2-core VM, 300-token replies: updates every 0.25 s let the page decode at 0.70-0.82x the API's rate,
# every 0.5 s at 0.84-0.91x
PAGE_UPDATE_SECONDS = 0.5

StartTurn = Callable[[Callable[[int, int], None]], Iterator[GenerationEvent]]


def too_long(check, attached: bool) -> str:
    """Why a message cannot be sent (it does not fit the window), by how much, and what to do instead."""
    over = check.needed_tokens - check.window
    if attached:
        return (f"This message with its attachments needs {check.needed_tokens:,} tokens (with room for a short "
                f"reply), {over:,} more than the model's window of {check.window:,}. Attach a smaller part of the "
                f"file (about {over:,} tokens less), start a new session, or load a model with a longer window. "
                f"Nothing was read or sent.")
    return (f"This message would bring the conversation to {check.needed_tokens:,} tokens, {over:,} beyond the "
            f"model's window of {check.window:,}. Start a new session, or press 'Drop oldest turns' "
            f"({check.droppable_turns} can go; the system prompt stays). Nothing was sent.")


class PageTurns:
    def __init__(self, pages: PageSessions) -> None:
        self.pages = pages
        self.turns, self.open, self.store, self.settings = pages.turns, pages.open, pages.store, pages.settings

    def send(self, text: str, attachments: Sequence[Document] = ()) -> Iterator[list[dict]]:
        """Send `text` after the attached documents' text. A new session's first message starts from the
        longest token prefix another session stored (a document read before is not read again)."""
        text = text or ""
        if not text.strip() and not attachments:
            raise UserError("The message is empty: type something first.")
        self.pages.require_chat()
        chat = self.open.page
        content, records = chat.user_message(text, attachments)
        check = chat.check_window(content)
        if not check.fits:
            raise UserError(too_long(check, bool(attachments)))
        if not chat.messages and self.store.get(chat.id).title == "New chat":
            first_line = text.strip().splitlines()[0] if text.strip() else f"About {attachments[0].name}"
            self.store.rename(chat.id, first_line[:60])  # a title worth listing

        def start(progress):
            chat = self.open.page
            if not chat.messages:
                self.open.start_from_stored_prefix(chat, chat.prompt_ids(content))
            return chat.send(text, self._sampling(), self.turns.cancel, progress, attachments=attachments)

        # the message shows at once, before the model has read it (a long document takes a while)
        yield from self._run(start, self.pages.chat_history() + [{"role": "user",
                                                                  "content": displayed_message(content, records)}])

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

    def _run(self, start_turn: StartTurn, shown_first: list[dict] | None = None) -> Iterator[list[dict]]:
        with self.turns.exclusive():
            self.turns.cancel.clear()
            self.pages.restore_message = ""  # said once, after opening the session
            if shown_first is not None:
                yield shown_first
            try:
                # the turn runs on in the model's thread and never waits for the page (engine_thread.py)
                updates = self.turns.model_thread.paced(self._shown(start_turn), PAGE_UPDATE_SECONDS,
                                                        self.turns.stop)
                with contextlib.closing(updates):  # a page that goes away stops the turn and waits for it
                    for shown in updates:
                        history, reply = shown[-1]
                        yield history + [{"role": "assistant", "content": reply}]
            except (SessionError, ContextOverflowError, ConfigError) as error:
                raise UserError(str(error)) from None
            finally:
                self.turns.idle()
        yield self.pages.chat_history()

    def _shown(self, start_turn: StartTurn) -> Iterator[tuple[list[dict], str]]:
        """The turn, in the model's thread: (the conversation before the reply, the reply so far) per event."""
        chat = self.open.page
        self.open.hold(chat, self.turns.start("restore"))
        self.settings.apply_pending(self.pages.host.engine, self.store, chat.id)
        history = None
        for event in self.turns.track(start_turn(self.turns.start("prefill"))):
            if history is None:  # the turn's first step stores or removes messages: read them after it
                history = self.pages.chat_history()
            yield history, event.full_text
