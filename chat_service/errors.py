"""The app's user-facing failures: each message is meant to be shown as it is; nothing was lost."""

from __future__ import annotations

BUSY = "A reply is being generated: press Stop or wait for it to finish."


class UserError(Exception):
    """A problem to show the user; nothing was lost."""


class QueueFull(UserError):
    """Too many API requests are already waiting for their turn."""


class Abandoned(UserError):
    """The API client went away before its turn came."""
