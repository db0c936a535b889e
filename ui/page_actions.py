"""The page's event handlers: each calls the controller and returns what its outputs show. A `UserError` is
shown as an error toast by `shows_errors`, written once here."""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import gradio as gr

from documents import Document, DocumentError, convert_file, documents_of

from . import inspector, panels
from .controller import ChatController, UserError
from .page_text import find, session_choices, session_details, status_text

ERROR_SECONDS = 12
# what the message box's attach button offers (any other name is still checked by its content when dropped)
ATTACHABLE = (".pdf", ".docx", ".html", ".htm", ".xhtml", ".txt", ".md", ".markdown", ".csv", ".json", ".xml",
              ".py", ".rst", ".log", ".tex")
EMPTY_BOX = {"text": "", "files": []}
PANEL_OUTPUTS = 10  # the tick's outputs between the status line and its state: 4 plots, 2 pickers, 4 views
CONVERTED_KEPT = 8  # converted attachments kept for the send that follows their preview
TICK_SECONDS = 2.0  # the live panels' pace between replies
# ... and while a reply is generated: each tick costs the browser ~30 ms of the cores the model decodes on (Gradio's
# frontend copies the value of every component that ever had a status, at every event). `python -m bench page`:
# the page decoded at a median 0.85-0.91x the API's rate with a tick every 2 s, 0.95x with none
TICK_SECONDS_WHILE_GENERATING = 10.0


@dataclass(frozen=True)
class TickState:
    """What one page was last sent by the tick: the engine's step count, session, model and API turns seen,
    the status text, each panel's view digest, the panel to try first next, and whether panels still wait."""
    seen: tuple | None = None
    status: str = ""
    interval: float = TICK_SECONDS  # the timer's, as this page was last told
    sent: dict[str, str] = field(default_factory=dict)
    next_panel: int = 0
    panels_pending: bool = False


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


class PageActions:
    def __init__(self, controller: ChatController, export_dir: Path) -> None:
        self.controller, self.export_dir = controller, export_dir
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
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
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
        """Each attachment's card and how much of the model's window the message would take."""
        controller = self.controller
        if not documents or controller.engine is None or controller.chat is None:
            return ""
        chat = controller.chat
        content, records = chat.user_message(text or "", documents)
        check = chat.check_window(content)
        cards = "  \n".join(f"📄 **{r['name']}** · {d.extent()} · {r['tokens']:,} tokens"
                            for d, r in zip(documents, records))
        share = f"This message would take {check.needed_tokens:,} of the model's {check.window:,}-token window" \
                f" ({100 * check.needed_tokens / check.window:.0f}%)."
        if not check.fits:
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
        chat = self.controller.chat
        last = next((m for m in reversed(chat.messages) if m.attachments), None) if chat is not None else None
        if last is None:
            raise UserError("No file is attached in this session: attach one first (the clip in the message box).")
        documents = documents_of(last.content, last.attachments)
        self.controller.new_session()
        self.pending = documents
        return self.history(), EMPTY_BOX, self.describe_attachments(documents, "") + \
            "  \nAttached again: type your question and press Enter."

    # ---------------------------------------------------------------- the sidebar
    # the sidebar after an action: the session list, the open session's title, system prompt and details, and
    # the status line (a turn that just ended says so at once, not at the next tick) (a comment, not a
    # docstring: Gradio would publish it as the description of this public endpoint)
    def refresh_sessions(self):
        current = self.controller.chat.id if self.controller.chat is not None else None
        summaries = self.controller.store.list()
        summary = find(summaries, current)
        return gr.update(choices=session_choices(summaries), value=current), \
            (summary.title if summary else ""), (summary.system_prompt if summary else ""), \
            session_details(summary), status_text(self.controller)

    def history(self) -> list[dict]:
        return self.controller.chat_history()

    # ---------------------------------------------------------------- turns
    @shows_errors
    def send(self, value) -> Iterator[tuple[list[dict], dict, str]]:
        """The message box's text and files ({"text", "files"}; a plain string from scripts)."""
        value = {"text": value, "files": []} if isinstance(value, str) or value is None else value
        documents = self.documents(value)
        # the first update shows the message before the model reads it; the box is emptied (once) by the
        # second, when the turn has started: a turn refused before then leaves the message where it was
        updates = 0
        try:
            for history in self.controller.send(value.get("text") or "", documents):
                updates += 1
                if updates == 2:
                    self.pending = []
                    yield history, EMPTY_BOX, ""
                else:
                    yield history, gr.skip(), gr.skip()
        except UserError:
            if updates == 1:  # the message was shown but not sent: the chat as it is, the box as it was
                yield self.history(), gr.skip(), gr.skip()
            raise
        sent = updates >= 2
        if documents and sent:
            yield history, EMPTY_BOX, self.tokens_read_note()

    def send_text(self, text: str) -> Iterator[tuple[list[dict], str]]:
        """`/send` for scripts: a plain message in, (history, "") out, as before the box took files."""
        for history, _box, _note in self.send(text):
            yield history, ""

    def edit_text(self, text: str) -> Iterator[tuple[list[dict], str]]:
        """`/edit_last` for scripts, likewise."""
        for history, _box in self.edit(text):
            yield history, ""

    def tokens_read_note(self) -> str:
        """After a turn with attachments: how much of its prompt the model read, and how much came from stored KV
        (a chat about a file read before starts from that chat's KV)."""
        chat = self.controller.chat
        reply = chat.messages[-1] if chat is not None and chat.messages else None
        if reply is None or reply.role != "assistant":
            return ""
        prompt, read = reply.token_start, chat.last_read_tokens
        if read < prompt:
            return f"Read {read:,} new tokens; the other {prompt - read:,} of this {prompt:,}-token prompt came " \
                   f"from the stored KV of an earlier chat about the same file."
        return f"Read all {prompt:,} tokens of this prompt once; a new chat about the same file starts from " \
               f"its stored KV."

    @shows_errors
    def regenerate(self) -> Iterator[list[dict]]:
        yield from self.controller.regenerate()

    @shows_errors
    def edit(self, value) -> Iterator[tuple[list[dict], dict]]:
        for number, history in enumerate(self.controller.edit_last(_text(value))):
            yield history, EMPTY_BOX if number == 0 else gr.skip()  # the box is emptied once, as the turn starts

    def stop(self) -> str:
        self.controller.stop()
        return "Stopping after the current token; what was generated is kept."

    @shows_errors
    def drop(self, value) -> list[dict]:
        gr.Info(self.controller.drop_oldest_turns(_text(value)))
        return self.history()

    # ---------------------------------------------------------------- sessions
    @shows_errors
    def open(self, session_id):
        if session_id:
            self.controller.open_session(session_id)
            self.pending = []  # files attached again for a new chat stay with that chat
        return self.history(), status_text(self.controller)

    @shows_errors
    def new(self) -> list[dict]:
        self.pending = []
        self.controller.new_session()
        return self.history()

    @shows_errors
    def rename(self, title) -> None:
        self.controller.rename_session(title)

    @shows_errors
    def delete(self) -> list[dict]:
        self.controller.delete_session()
        return self.history()

    @shows_errors
    def export(self) -> str:
        return str(self.controller.export_session(self.export_dir))

    @shows_errors
    def import_(self, path) -> list[dict]:
        if path:
            self.controller.import_session(path)
        return self.history()

    @shows_errors
    def branch(self, number) -> list[dict]:
        self.controller.branch_from(int(number or 1) - 1)
        return self.history()

    @shows_errors
    def system_prompt(self, text) -> str:
        self.controller.set_system_prompt(text or "")
        return "System prompt saved; it applies from the next message."

    # ---------------------------------------------------------------- model and settings
    @shows_errors
    def switch_model(self, choice, path):
        controller = self.controller
        gr.Info(controller.switch_model((path or "").strip() or choice))
        return self.history(), controller.model_summary(), gr.update(
            choices=controller.model_choices(), value=controller.model_path or controller.DEFAULT_CHOICE)

    @shows_errors
    def apply_settings(self, *values) -> str:
        return self.controller.apply_settings(*values)

    @shows_errors
    def storage(self, kv_format_value, limit) -> str:
        return self.controller.apply_storage(kv_format_value, limit)

    # ---------------------------------------------------------------- live panels, inspector, scripts
    def tick(self, last: "TickState | None"):
        """Refresh what changed since this page's last tick (`last`, kept per page in a gr.State): the status
        line when its text changed, the sidebar when another session or model is open or the API ran a turn,
        and at most one live panel, the next one in turn whose view changed; each output left alone is a
        gr.skip(), which sends nothing. While a reply is being generated only the status line and the heat
        map go out, and the timer ticks less often (every update costs the browser, which shares the model's
        cores); the rest follows the turn."""
        *outputs, now = self._refreshed(last or TickState())
        interval = TICK_SECONDS_WHILE_GENERATING if self.controller.busy else TICK_SECONDS
        timer = gr.update(value=interval) if interval != now.interval else gr.skip()
        return (*outputs, timer, replace(now, interval=interval))

    def _refreshed(self, last: "TickState") -> tuple:
        """The tick's outputs but the timer: the status line, the panels, pickers and views, and the state."""
        controller = self.controller
        text = status_text(controller)
        status = text if text != last.status else gr.skip()
        engine = controller.engine
        seen = (engine.steps_run, controller.chat.id if controller.chat else None, id(engine),
                controller.api_turns) if engine else None
        if engine is None or (seen == last.seen and not last.panels_pending):
            return (status, *[gr.skip()] * PANEL_OUTPUTS, replace(last, status=text))
        if controller.busy:  # `seen` stays as it was: the first tick after the turn refreshes the rest
            plots, now = self._next_panel(engine, replace(last, status=text), panels.LIVE_WHILE_GENERATING)
            return (status, *plots, *[gr.skip()] * (PANEL_OUTPUTS - len(plots)), now)
        plots, now = self._next_panel(engine, replace(last, status=text, seen=seen))
        if seen == last.seen:  # only a panel left over from the last steps
            return (status, *plots, *[gr.skip()] * (PANEL_OUTPUTS - len(plots)), now)
        # the page may have opened before the model and the last session were loaded: show them now
        session_changed = last.seen is None or last.seen[1:3] != seen[1:3]  # another session or model
        history = self.history() if session_changed else gr.skip()
        picker = details = model = gr.skip()
        if session_changed:
            model = controller.model_summary()
        if session_changed or last.seen[3] != seen[3]:  # an API turn may have added or grown a session
            summaries = controller.store.list()
            picker = gr.update(choices=session_choices(summaries), value=seen[1])
            details = session_details(find(summaries, seen[1]))
        labels = inspector.step_labels(engine)
        steps = gr.update(choices=labels, value=labels[-1] if labels else None)
        layers = gr.update(maximum=engine.adapter.num_layers - 1)
        return (status, *plots, steps, layers, history, picker, details, model, now)

    def _next_panel(self, engine, last: "TickState",
                    candidates: tuple[str, ...] = panels.PANELS) -> tuple[list, "TickState"]:
        """The four plots' outputs: the next panel in turn among `candidates` whose table differs from what this
        page was sent, the others skipped (at most one Vega redraw per tick, in the browser that shares the
        model's cores)."""
        views = panels.panel_views(panels.collect(engine, self.controller.progress.tokens_per_second()))
        digests = {name: panels.digest(view) for name, view in views.items()}
        count = len(panels.PANELS)
        order = [panels.PANELS[(last.next_panel + i) % count] for i in range(count)]
        changed = [name for name in order if digests[name] != last.sent.get(name)]
        sendable = [name for name in changed if name in candidates]
        if not sendable:
            return [gr.skip()] * count, replace(last, panels_pending=bool(changed))
        name = sendable[0]
        value, caption = views[name]
        # a plot takes its table and caption; an HTML panel (the heat map) carries its caption inside
        update = gr.update(value=value) if isinstance(value, str) else gr.update(value=value, caption=caption)
        plots = [update if panel == name else gr.skip() for panel in panels.PANELS]
        return plots, replace(last, sent={**last.sent, name: digests[name]},
                              next_panel=(panels.PANELS.index(name) + 1) % count, panels_pending=len(changed) > 1)

    def inspect(self, step_label, layer) -> str:
        if self.controller.engine is None or not step_label:
            return "<p>Generate a reply first.</p>"
        return self.controller.inspect(int(str(step_label).split(":")[0]), int(layer))

    def inspect_index(self, step_index, layer) -> str:
        if self.controller.engine is None:
            return "<p>Still starting.</p>"
        return self.controller.inspect(int(step_index or 0), int(layer or 0))

    def list_sessions(self) -> list[dict]:
        return [{**s.__dict__, "reopens_instantly": s.reopens_instantly} for s in self.controller.store.list()]

    def app_status(self) -> dict:
        controller = self.controller
        return {"ready": controller.engine is not None and controller.ready.is_set(),
                "status": controller.status, "error": controller.load_error,
                "restore": controller.restore_message, "session": controller.chat.id if controller.chat else None,
                "last_read_tokens": controller.chat.last_read_tokens if controller.chat else None}


def _text(value) -> str:
    """The text of the message box's value (a dict from the page, a string from scripts)."""
    return value if isinstance(value, str) else (value or {}).get("text") or ""
