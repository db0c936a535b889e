"""Errors of the sessions package; every message says what happened and what to do."""

from __future__ import annotations


class SessionError(Exception):
    pass


class SessionNotFoundError(SessionError):
    pass


class SessionLockedError(SessionError):
    """The session is open in another window or process."""


class ImportValidationError(SessionError):
    """An imported file is malformed, hostile or inconsistent; nothing was written."""


class ContextWindowError(SessionError):
    """The next turn does not fit the model's window; carries the WindowCheck with the options."""

    def __init__(self, check, attached: bool = False) -> None:
        self.check = check
        super().__init__(check.explain(attached))  # the one wording (sessions.chat.WindowCheck)
