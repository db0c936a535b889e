"""The page's turns: send, regenerate, replace the last message, drop the oldest turns. Each streams the
conversation as the chat display shows it; one runs at a time (another gets UserError(BUSY)). Given a LiveReply
(live_replies.py), a turn writes the reply's text there as it grows and shows the chat only as the reply
starts (its last message LIVE_PLACEHOLDER) and when the turn is over; whoever opened the reply finishes it.

    for history in page_turns.send("Hello"): show(history)
    for history in page_turns.send("Hello", live=replies.open(reply_id)): show(history)   # the text: in `live`
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from documents import Document, attachment_record, displayed_message, message_with_attachments
from infinigen_core import GenerationEvent
from sessions import SessionError
from sessions.overflow import OVERFLOW_LABEL

from .document_reading import DocumentReader
from .errors import UserError
from .live_replies import LiveReply
from .out_of_window import OutOfWindow
from .page_sessions import PageSessions
from .remote_chat import OpenChat
from .titles import session_title
from .turns import Progress

# how often the reply's new text goes out while a turn runs: to the page's live reply (its own turns), or in
# the chat display's update (a script's /send), which the server post-processes and sends and the browser
# redraws, on the cores the model decodes on. `python -m bench page` on the 2-core VM, 300-token replies, in
# Gradio's updates: every 0.25 s the page decoded at 0.70-0.82x the API's rate, every 0.5 s at 0.84-0.91x; by
# the live reply, 200 tokens, 0.25 s against 0.5 s within the rounds' scatter (docs/BENCHMARKS.md)
PAGE_UPDATE_SECONDS = 0.5
# the reply's message in the chat while its text goes to a live reply (the page shows the text in its place)
LIVE_PLACEHOLDER = "…"

Generate = Callable[[OpenChat, Progress], Iterator[GenerationEvent]]


class PageTurns:
    def __init__(self, pages: PageSessions, documents: DocumentReader) -> None:
        self.pages, self.documents = pages, documents
        self.turns, self.open, self.store, self.settings = pages.turns, pages.open, pages.store, pages.settings
        self.waiting_for_model = 0  # messages sent while the model loads, sent once it is ready
        self.out_of_window = OutOfWindow()  # the turns the overflow setting dropped, for the context meter

    def send(self, text: str, attachments: Sequence[Document] = (), live: LiveReply | None = None
             ) -> Iterator[list[dict]]:
        """Send `text` after the attached documents' text (a document that does not fit the window: the passages
        read for `text`). A new session's first message starts from the longest token prefix another session
        stored (a document read before is not read again). A message sent while the model loads is shown at
        once and sent when the model is ready."""
        text = text or ""
        if not text.strip() and not attachments:
            raise UserError("The message is empty: type something first.")
        shown_while_waiting = not self.pages.host.ready.is_set()
        if shown_while_waiting:
            yield self._shown_waiting(text, attachments)
            self._wait_for_model()
        chat = self.pages.require_chat()
        attachments = self.documents.for_page(chat, text, attachments)
        content, records = chat.user_message(text, attachments)
        overflow = self.settings.current.overflow
        check = chat.check_window(content)
        if not check.fits and (overflow == "stop" or not chat.messages):
            setting = f" Or let Settings' “{OVERFLOW_LABEL}” drop them for you." if check.droppable_turns else ""
            passages = any(document.read is not None for document in attachments)
            raise UserError(check.explain(attached=bool(attachments), passages=passages) + setting)
        if not chat.messages and self.store.get(chat.id).title == "New chat":
            self.store.rename(chat.id, session_title(text, attachments))  # a title worth listing

        def generate(chat: OpenChat, progress: Progress) -> Iterator[GenerationEvent]:
            # before the message is read, whole turns go (a remote session's counted by its server; one whose
            # server counts nothing fits by its rule, and a prompt over the window is refused by the server)
            if overflow != "stop" and not chat.check_window(content).fits:
                self.out_of_window.drop(chat, content, overflow)
            if not chat.messages:
                self.open.start_from_stored_prefix(chat, chat.prompt_ids(content))
            return chat.send(text, self._sampling(), self.turns.cancel, progress, attachments=tuple(attachments))

        # the message shows at once, before the model has read it (a long document takes a while)
        shown = self.pages.chat_history() + [{"role": "user", "content": displayed_message(content, records)}]
        yield from self._run(generate, None if shown_while_waiting else shown, live)

    @staticmethod
    def _shown_waiting(text: str, attachments: Sequence[Document]) -> list[dict]:
        """The message as shown while it waits for the model (which opens the latest session once loaded)."""
        records = [attachment_record(document) for document in attachments]
        return [{"role": "user", "content": displayed_message(message_with_attachments(text.strip(), attachments),
                                                              records)}]

    def _wait_for_model(self) -> None:
        self.waiting_for_model += 1  # the status line says so
        try:
            self.pages.host.ready.wait()
        finally:
            self.waiting_for_model -= 1

    def regenerate(self, live: LiveReply | None = None) -> Iterator[list[dict]]:
        self.pages.require_chat()
        yield from self._run(lambda chat, progress: chat.regenerate(self._sampling(), self.turns.cancel, progress),
                             live=live)

    def edit_last(self, text: str, live: LiveReply | None = None) -> Iterator[list[dict]]:
        if not text or not text.strip():
            raise UserError("The edited message is empty: type something first.")
        self.pages.require_chat()
        yield from self._run(lambda chat, progress: chat.edit_last_user(text, self._sampling(), self.turns.cancel,
                                                                        progress), live=live)

    def drop_oldest_turns(self, text: str) -> str:
        chat = self.pages.require_chat()
        with self.turns.exclusive():
            try:
                # a remote session is counted by its server (or it says why it cannot)
                dropped = self.out_of_window.drop(chat, text or "", "drop_oldest")
            except SessionError as error:
                raise UserError(str(error)) from None
        return f"Dropped the {dropped} oldest turn(s); the system prompt was kept."

    def _sampling(self):
        return self.settings.current.sampling

    def _held_page_session(self) -> OpenChat:
        """In the model's thread: the page's session, its KV read back if the API used the engine since."""
        chat = self.pages.require_chat()
        self.open.hold(chat, self.turns.start("restore"))
        return chat

    def _before_reply(self) -> list[dict]:
        """The chat before the reply: once its first token came, the reply begun is stored as the last message
        (and updated as it grows), so a reply's update shown after it would show it twice."""
        history = self.pages.chat_history()
        return history[:-1] if history and history[-1]["role"] == "assistant" else history

    def _run(self, generate: Generate, shown_first: list[dict] | None = None, live: LiveReply | None = None
             ) -> Iterator[list[dict]]:
        """The turn's chat updates; with `live`, the reply's text goes there, and the chat is shown with the
        placeholder once, as the reply starts (a turn that fails after that shows the chat as stored, then
        raises)."""
        history = None
        try:
            with self.turns.exclusive():
                self.pages.restore_message = ""  # said once, after opening the session
                if shown_first is not None:
                    yield shown_first
                for events in self.turns.run(self._held_page_session, generate, PAGE_UPDATE_SECONDS,
                                             self.turns.stop):
                    text = events[-1].full_text
                    if live is not None:
                        live.write(text)
                    starts = history is None
                    if history is None:  # the turn's first step stores or removes messages: read them after it
                        history = self._before_reply()
                    if live is None or starts:
                        yield history + [{"role": "assistant", "content": LIVE_PLACEHOLDER if live else text}]
        except Exception:  # a UserError, or any failure of the model's thread (not the page going away)
            if live is not None and history is not None:  # the placeholder goes: the chat as it is stored
                yield self.pages.chat_history()
            raise
        yield self.pages.chat_history()
