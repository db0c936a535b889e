"""The page's session actions: open, new, rename, delete, export, import, branch, system prompt.

Each raises UserError with a message to show; opening a session restores its KV and says how
(`restore_message`).
"""

from __future__ import annotations

from pathlib import Path

from documents import displayed_message
from sessions import RestoreReport, SessionError, SessionStore
from sessions.archive import ImportLimits

from .errors import UserError
from .model_host import ModelHost
from .open_sessions import OpenSessions
from .remote_chat import OpenChat
from .settings import SettingsKeeper
from .turns import TurnRunner


def describe_restore(report: RestoreReport) -> str:
    """How a session's KV came back, in a sentence for the status line."""
    if report.rebuilt:
        return (f"The saved KV cache could not be used ({report.reason}); rebuilt it by "
                f"re-reading {report.tokens_prefilled} tokens in {report.seconds:.1f} s. No message was lost.")
    if report.tokens_restored and report.tokens_prefilled:
        return (f"Restored {report.tokens_restored} tokens of this model's saved KV cache from disk and read the "
                f"{report.tokens_prefilled} tokens it did not hold (said under another model since) in "
                f"{report.seconds:.2f} s.")
    if report.tokens_restored:
        return f"Restored {report.tokens_restored} tokens from disk in {report.seconds:.2f} s (no recomputation)."
    return "New conversation."


class PageSessions:
    def __init__(self, store: SessionStore, host: ModelHost, settings: SettingsKeeper, turns: TurnRunner,
                 open_sessions: OpenSessions) -> None:
        self.store, self.host, self.settings, self.turns, self.open = store, host, settings, turns, open_sessions
        self.restore_message = ""

    def require_chat(self) -> OpenChat:
        """The page's session (UserError while starting, or when none is open)."""
        self.host.require_loaded()
        if self.open.page is None:
            raise UserError("no session is open")
        return self.open.page

    def chat_history(self) -> list[dict]:
        if self.open.page is None:
            return []
        # an attachment shows as its card, not as the pages of text the model reads
        return [{"role": m.role, "content": displayed_message(m.content, m.attachments)}
                for m in self.open.page.messages]

    def open_latest_free(self) -> None:
        """The most recent page session that no other window or process holds; a new one when all are taken.
        API sessions are left to their clients (the page opens one only when asked)."""
        for summary in self.store.list():
            if summary.origin == "api":
                continue
            try:
                self.open_session(summary.id)
                return
            except UserError:  # open in another app process: leave it to that one
                continue
        self.new_session()

    def new_session(self, system_prompt: str = "") -> str:
        session_id = self.store.create("New chat", system_prompt, self.settings.record(), self.host.fingerprint())
        if self.host.engine is not None or self.host.remote:
            self.open_session(session_id)
        return session_id

    def open_session(self, session_id: str) -> str:
        self.host.require_loaded()
        with self.turns.exclusive():
            return self.turns.model_thread.call(self._open, session_id)  # restoring runs the model's kernels

    def _open(self, session_id: str) -> str:
        if self.open.page is not None and self.open.page.id == session_id:
            return self.restore_message
        previous, self.open.page = self.open.page, None
        self.open.release(previous)
        on_restore = self.turns.start("restore")
        try:
            if self.open.api is not None and self.open.api.id == session_id:  # the API has it open: share it
                self.open.page = self.open.api
                self.open.hold(self.open.page, on_restore)
            else:
                self.open.page = self.open.open(session_id, on_restore)
        except SessionError as error:
            if previous is not None:  # stay where we were
                self.open.page = previous if previous is self.open.api else self.open.open(previous.id)
            raise UserError(str(error)) from None
        finally:
            self.turns.idle()
        self.restore_message = describe_restore(self.open.page.restore)
        return self.restore_message

    def rename_session(self, title: str) -> None:
        chat = self.require_chat()
        try:
            self.store.rename(chat.id, title)
        except ValueError as error:
            raise UserError(str(error)) from None

    def delete_session(self) -> None:
        doomed = self.require_chat()
        with self.turns.exclusive():
            self.open.page = None
            if self.open.api is doomed:
                self.open.api = None
            self.open.release(doomed)
            self.store.delete(doomed.id)
        self.open_latest_free()

    def export_session(self, folder: Path) -> Path:
        chat_id = self.require_chat().id
        title = "".join(c if c.isalnum() else "-" for c in self.store.get(chat_id).title)[:40] or "chat"
        return self.store.export(chat_id, Path(folder) / f"{title}.igchat")

    def import_session(self, path: str | Path) -> str:
        self.turns.refuse_while_generating()
        try:
            window = self.host.engine.max_context if self.host.engine is not None else None
            session_id = self.store.import_file(path, ImportLimits(window=window))
        except SessionError as error:
            raise UserError(str(error)) from None
        self.open_session(session_id)
        return session_id

    def branch_from(self, message_index: int) -> str:
        chat = self.require_chat()
        messages = chat.messages
        if not 0 <= message_index < len(messages):
            raise UserError(f"there is no message {message_index + 1} to branch from")
        self.turns.refuse_while_generating()
        branch_id = self.store.branch(chat.id, messages[message_index].id)
        self.open_session(branch_id)
        return branch_id

    def set_system_prompt(self, text: str) -> None:
        chat = self.require_chat()
        if text != chat.system_prompt:
            chat.set_system_prompt(text)
