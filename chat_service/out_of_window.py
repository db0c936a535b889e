"""The turns dropped from the page's sessions to fit the model's window, by the overflow setting ("When the
chat outgrows the window") or the "Drop oldest turns" button, kept for the context meter.

    out = OutOfWindow()
    out.drop(chat, "the new message", "drop_oldest")    # turns dropped (UserError when nothing allowed fits)
    out.listed(chat.id)                                 # ['What is the capital of France?', ...] oldest first
"""

from __future__ import annotations

from documents import question_of
from sessions import ContextWindowError
from sessions.overflow import OVERFLOW_POLICIES
from sessions.stored_conversation import StoredConversation

from .errors import UserError

PREVIEW_CHARS = 48  # of each dropped question, as the meter lists it


def preview(text: str) -> str:
    """A one-line start of a message: 'What is the capital of…'."""
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW_CHARS else line[: PREVIEW_CHARS - 1].rstrip() + "…"


class OutOfWindow:
    def __init__(self) -> None:
        # per session, the dropped turns' questions, oldest first (this process's page; the store keeps only
        # the shortened conversation, which is what the model reads and what reopening shows)
        self._dropped: dict[str, list[str]] = {}

    def drop(self, chat: StoredConversation, text: str, policy: str) -> int:
        """Drop whole turns from `chat` (any open session: StoredConversation.fit_window) so that a user message
        `text` and a short reply fit, as `policy` ("drop_oldest" or "keep_first") allows; returns how many turns
        went. UserError when even that does not fit (then nothing is dropped); SessionError when a remote
        session's server counts nothing."""
        try:
            gone = chat.fit_window(text, keep_first=policy == "keep_first")
        except ContextWindowError as error:
            kept = "the system prompt, the first turn and the last" if policy == "keep_first" else \
                "the system prompt and the last turn"
            raise UserError(f"This message does not fit the model's window of {error.check.window:,} tokens even "
                            f"with the earlier turns dropped ({OVERFLOW_POLICIES[policy]}: {kept} stay). Shorten it "
                            f"or attach a smaller part of the file, start a new session, or load a model with a "
                            f"longer window. Nothing was sent or dropped.") from None
        questions = [preview(question_of(m.content, m.attachments)) for m in gone if m.role == "user"]
        self._dropped.setdefault(chat.id, []).extend(questions)
        return len(questions)

    def listed(self, session_id: str) -> list[str]:
        """The questions of the turns dropped from this session so far, oldest first."""
        return list(self._dropped.get(session_id, ()))
