"""The page's event handlers: each calls the part of the service it needs and returns what its outputs show. A `UserError` is
shown as an error toast by `shows_errors`, written once here."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import gradio as gr

from chat_service import ChatService, UserError
from chat_service.live_replies import LiveReplies, LiveReply
from chat_service.settings import SettingsForm, apply_storage
from documents import Document, DocumentError, convert_file, documents_of
from documents.convert import attachment_digest
from documents.fitting import is_read_above

from . import inspector
from .page_text import (
    card_line,
    context_meter,
    find,
    holds_file,
    search_snippets,
    session_choices,
    session_details,
    status_text,
    tokens_read_note,
)
from .temp_folders import remove_upload

ERROR_SECONDS = 12
# what the message box's attach button offers (any other name is still checked by its content when dropped)
ATTACHABLE = (".pdf", ".docx", ".html", ".htm", ".xhtml", ".txt", ".md", ".markdown", ".csv", ".json", ".xml",
              ".py", ".rst", ".log", ".tex")
EMPTY_BOX = {"text": "", "files": []}
CONVERTED_KEPT = 8  # converted attachments kept for the send that follows their preview

def shows_errors(handler: Callable) -> Callable:
    """A handler whose UserError is shown on the page as an error toast (a streaming handler's too)."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def streaming(*args):
            try:
                yield from handler(*args)
            except UserError as error:
                raise gr.Error(str(error), duration=ERROR_SECONDS) from None

        return streaming

    @functools.wraps(handler)
    def plain(*args):
        try:
            return handler(*args)
        except UserError as error:
            raise gr.Error(str(error), duration=ERROR_SECONDS) from None

    return plain

@contextlib.contextmanager
def _live(replies: LiveReplies, reply_id: str) -> Iterator[LiveReply | None]:
    """The live reply the page asked for (None: none, or not an id the page makes), finished however the handler
    ends (a message refused before its turn: its reader stops waiting)."""
    live = replies.open(reply_id)
    try:
        yield live
    finally:
        if live is not None:
            live.finish()


class PageActions:
    def __init__(self, service: ChatService, export_dir: Path) -> None:
        self.service, self.export_dir = service, export_dir
        # by the file's sha256, the most recent few: a file is converted once, not again when the message is sent
        self._converted: OrderedDict[str, Document] = OrderedDict()
        self.pending: list[Document] = []  # attached again by "New chat about this file", sent with the next message

    # ---------------------------------------------------------------- attachments
    def documents(self, value) -> list[Document]:
        """The message box's files as documents (converted once, cached by content), after those attached again.
        A file that cannot be attached raises UserError with the converter's sentence."""
        found = list(self.pending)
        for item in (value or {}).get("files") or []:
            path = Path(item if isinstance(item, str) else item.get("path", ""))
            try:
                digest = attachment_digest(path)  # its size checked before it is read
                name = path.name if isinstance(item, str) else (item.get("orig_name") or path.name)
                document = self._converted.get(digest)
                if document is None or document.name != name:
                    document = self._converted[digest] = convert_file(path, name)
                self._converted.move_to_end(digest)
                while len(self._converted) > CONVERTED_KEPT:  # each holds up to 2,000,000 characters
                    self._converted.popitem(last=False)
            except DocumentError as error:
                raise UserError(str(error)) from None
            except OSError as error:
                raise UserError(f"{path.name} could not be read ({error.strerror}). Attach it again.") from None
            found.append(document)
        return found

    def describe_attachments(self, documents: list[Document], text: str) -> str:
        """Each attachment's card and how much of the model's window the message would take; a document too long
        to read whole says so, and which passages the question typed so far would read."""
        chat = self.service.open_sessions.page
        if not documents or self.service.host.engine is None or chat is None:
            return ""
        read = self.service.documents.for_page(chat, text or "", documents)
        content, _ = chat.user_message(text or "", read)
        check = chat.check_window(content)
        _, records = chat.user_message("", documents)  # each one whole, for its size
        cards = "  \n".join(card_line(d, r, fitted, check.window) for d, r, fitted in zip(documents, records, read))
        share = f"This message would take {check.needed_tokens:,} of the model's {check.window:,}-token window" \
                f" ({100 * check.needed_tokens / check.window:.0f}%)."
        if not check.fits and any(document.read is not None for document in read):
            share += (f" **It does not fit even by passages: {check.needed_tokens - check.window:,} tokens too "
                      f"many.** The question and the earlier turns take the room: shorten the question, drop the "
                      f"oldest turns, or start a new session.")
        elif not check.fits:
            share += (f" **It does not fit: {check.needed_tokens - check.window:,} tokens too many.** Attach a "
                      f"smaller part, or load a model with a longer window.")
        return f"{cards}  \n{share}"

    @shows_errors
    def preview(self, value) -> str:
        return self.describe_attachments(self.documents(value), (value or {}).get("text", ""))

    @shows_errors
    def file_chat(self):
        """A new session with the last attached document(s) of this one attached again (sent with the next
        message; read from the stored prefix, not again)."""
        chat = self.service.open_sessions.page
        # the last message that holds a file's text, and of it only the files whose text it holds (a file attached
        # again there is a reference to an earlier message's text, "[The same text as attached above.]")
        last = next((m for m in reversed(chat.messages) if any(not is_read_above(r) for r in m.attachments)),
                    None) if chat else None
        if last is None:
            raise UserError("No file is attached in this session: attach one first (the clip in the message box).")
        documents = [document for document, record in zip(documents_of(last.content, last.attachments),
                                                           last.attachments) if not is_read_above(record)]
        self.service.pages.new_session()
        self.pending = documents
        return self.history(), EMPTY_BOX, self.describe_attachments(documents, "") + \
            "  \nAttached again: type your question and press Enter."

    # ---------------------------------------------------------------- the sidebar
    # the sidebar after an action: the session list, the open session's title, system prompt and details, and
    # the status line (a turn that just ended says so at once, not at the next tick) (a comment, not a
    # docstring: Gradio would publish it as the description of this public endpoint)
    def refresh_sessions(self):
        chat = self.service.open_sessions.page
        current = chat.id if chat is not None else None
        summaries = self.service.store.list()
        summary = find(summaries, current)
        messages = chat.messages if chat is not None else []  # read once, for the button and the meter
        has_file = holds_file(messages)
        remote = self.service.host.remote
        return gr.update(choices=session_choices(summaries, remote), value=current), \
            (summary.title if summary else ""), (summary.system_prompt if summary else ""), \
            session_details(summary, remote), status_text(self.service), gr.update(visible=has_file), \
            context_meter(self.service, messages, summary)

    def _session_picker(self):
        """The session list as it is now (a turn that has just started has stored its message and title)."""
        chat = self.service.open_sessions.page
        return gr.update(choices=session_choices(self.service.store.list(), self.service.host.remote),
                         value=chat.id if chat else None)

    def history(self) -> list[dict]:
        return self.service.pages.chat_history()

    # ---------------------------------------------------------------- turns
    @shows_errors
    def send(self, value, reply_id: str = "") -> Iterator[tuple]:
        """The message box's text and files ({"text", "files"}; a plain string from scripts). Yields the chat,
        the box, the attachments' note, the status line and the session list, each gr.skip() when unchanged.
        With the page's `reply_id`, the reply's text goes to the page's own reader (ui/live_reply.py), and the
        chat is sent as the reply starts and when the turn is over."""
        with _live(self.service.live_replies, reply_id) as live:
            yield from self._send(value, live)

    def _send(self, value, live: LiveReply | None) -> Iterator[tuple]:
        value = {"text": value, "files": []} if isinstance(value, str) or value is None else value
        documents = self.documents(value)
        # the first update shows the message before the model reads it (or while it waits for the model to load);
        # the box is emptied (once) by the second, when the turn has started: a turn refused before then leaves
        # the message where it was. The status line follows the turn's phase (reading, replying) as it changes,
        # and the session list shows the new message's session at once
        skip, updates, phase = gr.skip(), 0, None
        try:
            for history in self.service.page_turns.send(value.get("text") or "", documents, live):
                updates += 1
                status, phase = self._status_on_change(phase)
                if updates == 2:
                    self.pending = []
                    yield history, EMPTY_BOX, "", status, self._session_picker()
                else:
                    yield history, skip, skip, status, skip
        except UserError:
            if updates == 1:  # the message was shown but not sent: the chat as it is, the box as it was
                yield self.history(), skip, skip, skip, skip
            raise
        chat = self.service.open_sessions.page
        if updates >= 2 and (documents or (chat is not None and holds_file(chat.messages))):
            yield history, EMPTY_BOX, self.tokens_read_note(), skip, skip

    def _status_on_change(self, shown_phase: str | None) -> tuple[object, str]:
        """The status line when the turn's phase differs from `shown_phase` (else gr.skip()), and the phase."""
        phase = self.service.turns.progress.phase
        if self.service.page_turns.waiting_for_model:
            phase = "waiting"
        return (status_text(self.service) if phase != shown_phase else gr.skip()), phase

    def send_text(self, text: str) -> Iterator[tuple[list[dict], str]]:
        """`/send` for scripts: a plain message in, (history, "") out, as before the box took files."""
        for history, *_ in self.send(text):
            yield history, ""

    def edit_text(self, text: str) -> Iterator[tuple[list[dict], str]]:
        """`/edit_last` for scripts, likewise."""
        for history, _box in self.edit(text):
            yield history, ""

    def tokens_read_note(self) -> str:
        return tokens_read_note(self.service.open_sessions.page)

    @shows_errors
    def regenerate(self, reply_id: str = "") -> Iterator[list[dict]]:
        with _live(self.service.live_replies, reply_id) as live:
            yield from self.service.page_turns.regenerate(live)

    @shows_errors
    def edit(self, value, reply_id: str = "") -> Iterator[tuple[list[dict], dict]]:
        with _live(self.service.live_replies, reply_id) as live:
            for number, history in enumerate(self.service.page_turns.edit_last(_text(value), live)):
                yield history, EMPTY_BOX if number == 0 else gr.skip()  # the box is emptied once, as the turn starts

    def stop(self) -> str:
        self.service.turns.stop()
        return "Stopping after the current token; what was generated is kept."

    @shows_errors
    def drop(self, value) -> list[dict]:
        gr.Info(self.service.page_turns.drop_oldest_turns(_text(value)))
        return self.history()

    # ---------------------------------------------------------------- sessions
    @shows_errors
    def open(self, session_id):
        if session_id:
            self.service.pages.open_session(session_id)
            self.pending = []  # files attached again for a new chat stay with that chat
        return self.history(), status_text(self.service)

    @shows_errors
    def new(self) -> list[dict]:
        self.pending = []
        self.service.pages.new_session()
        return self.history()

    @shows_errors
    def rename(self, title) -> None:
        self.service.pages.rename_session(title)

    @shows_errors
    def delete(self) -> list[dict]:
        self.service.pages.delete_session()
        return self.history()

    @shows_errors
    def export(self) -> str:
        return str(self.service.pages.export_session(self.export_dir))

    @shows_errors
    def import_(self, path) -> list[dict]:
        if path:
            try:
                self.service.pages.import_session(path)
            finally:
                remove_upload(path)  # the staged copy is in the data directory now, or refused
        return self.history()

    @shows_errors
    def branch(self, number) -> list[dict]:
        self.service.pages.branch_from(int(number or 1) - 1)
        return self.history()

    @shows_errors
    def system_prompt(self, text) -> str:
        self.service.pages.set_system_prompt(text or "")
        return "System prompt saved; it applies from the next message."

    # ---------------------------------------------------------------- model and settings
    @shows_errors
    def switch_model(self, choice, path):
        gr.Info(self.service.switch_model((path or "").strip() or choice))
        host = self.service.host
        return self.history(), host.model_summary(), gr.update(choices=host.model_choices(),
                                                               value=host.model_path or host.DEFAULT_CHOICE)

    @shows_errors
    def apply_settings(self, policy, alpha, budget, partial_ratio, pool_limit, inspect, temperature, top_p, top_k,
                       repetition_penalty, max_new_tokens, min_fetch_tokens=SettingsForm.min_fetch_tokens,
                       overflow=SettingsForm.overflow) -> str:
        """The page's settings inputs, bound by these parameters' names (ChatPage.settings_inputs); scripts
        call /apply_settings with the values in this order."""
        form = SettingsForm(policy=policy, alpha=alpha, budget=budget, partial_ratio=partial_ratio,
                            pool_limit=pool_limit, inspect=inspect, temperature=temperature, top_p=top_p, top_k=top_k,
                            repetition_penalty=repetition_penalty, max_new_tokens=max_new_tokens,
                            min_fetch_tokens=min_fetch_tokens, overflow=overflow)
        return self.service.settings.apply(self.service.host.engine, form)

    @shows_errors
    def storage(self, kv_format_value, limit) -> str:
        return apply_storage(self.service.store, kv_format_value, limit)

    # ---------------------------------------------------------------- inspector, scripts
    def inspect(self, step_label, layer) -> str:
        if self.service.host.engine is None or not step_label:
            return "<p>Generate a reply first.</p>"
        return self._inspected(int(str(step_label).split(":")[0]), int(layer))

    def inspect_index(self, step_index, layer) -> str:
        if self.service.host.engine is None:
            return "<p>Still starting.</p>"
        return self._inspected(int(step_index or 0), int(layer or 0))

    def _inspected(self, step_index: int, layer: int) -> str:
        """The prefetch inspector's HTML for a recent decode step (0 = the oldest kept) and a layer. It recomputes
        the layer's attention, so it runs in the model's thread (engine_thread.py), after a turn running there."""
        return self.service.turns.model_thread.call(inspector.render, self.service.host.engine, step_index, layer)

    def list_sessions(self) -> list[dict]:
        return [{**s.__dict__, "reopens_instantly": s.reopens_instantly} for s in self.service.store.list()]

    def search(self, text) -> list[dict]:
        """Saved chats holding every word of `text`, newest first: {session_id, title, snippet (HTML, the
        matching words in <mark>), message_index (None: the title matched), updated} (the /search endpoint)."""
        return [hit.as_dict() for hit in self.service.store.search(text or "")]

    def search_page(self, text):
        """The sidebar's search: the matching chats to pick from, their snippets, and each one's matching
        message ({session_id: position}, for `open_found`)."""
        hits = self.service.store.search(text) if (text or "").strip() else []
        choices = [(hit.title, hit.session_id) for hit in hits]
        found = {hit.session_id: hit.message_index for hit in hits}
        return gr.update(choices=choices, value=None, visible=bool(hits)), search_snippets(hits, text or ""), found

    def open_found(self, session_id, found):
        """A search hit chosen: its chat opened (as `open`), and where its matching message is for the page's
        script (ui/scroll_script.py): 'index/messages shown', or '' when only the title matched."""
        history, status = self.open(session_id)
        position = (found or {}).get(session_id)
        chat = self.service.open_sessions.page
        # a session's stored positions run 0, 1, 2, ... (SessionStore.add_messages, replace_messages and
        # delete_messages_from keep them so), and `history` shows one entry per message in that order
        shown = chat is not None and chat.id == session_id and isinstance(position, int) and \
            0 <= position < len(history)
        return history, status, f"{position}/{len(history)}" if shown else ""

    def app_status(self) -> dict:
        host, chat = self.service.host, self.service.open_sessions.page
        return {"ready": host.is_ready(),
                "status": host.status, "error": host.load_error,
                "restore": self.service.pages.restore_message, "session": chat.id if chat else None,
                "last_read_tokens": chat.last_read_tokens if chat else None}

def _text(value) -> str:
    """The text of the message box's value (a dict from the page, a string from scripts)."""
    return value if isinstance(value, str) else (value or {}).get("text") or ""
