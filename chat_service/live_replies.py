"""The text of a reply the page is waiting for, as it grows, for that page's own reader (ui/live_reply.py).

The page streams a reply outside Gradio's updates: each Gradio update makes its frontend copy the value of every
component that ever had a status, the whole conversation included (docs/BENCHMARKS.md, issue 35), on the cores
the model decodes on. The page names its reply with an id of 128 random bits when it sends; the turn writes the
reply's text under that id, and the page reads it from its own route until the reply is done.

    reply = replies.open(reply_id)       # the turn's side: None for an id that is not one
    reply.write("Hello"); reply.finish()
    replies.find(reply_id).read()        # the reader's side: LiveText(text, version, done)
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

REPLY_ID = re.compile(r"[0-9a-f]{32}")  # what the page sends: 16 random bytes in hex
KEPT_REPLIES = 16  # the most recent replies kept for a reader that comes late (a few KB of text each)


@dataclass(frozen=True)
class LiveText:
    text: str = ""
    version: int = 0  # one more at every write: a reader sends the text again only when it grew
    done: bool = False  # the turn is over (its reply complete, stopped or failed); the chat shows it now

    @property
    def started(self) -> bool:
        """The turn wrote text (each write and the one finish count a version): a reply refused before its turn
        began is done without."""
        return self.version > int(self.done)


class LiveReply:
    """One reply's text, written by the turn's thread and read by the page's route."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = LiveText()

    def write(self, text: str) -> None:
        with self._lock:
            if not self._state.done:
                self._state = LiveText(text, self._state.version + 1)

    def finish(self) -> None:
        with self._lock:
            if not self._state.done:
                self._state = LiveText(self._state.text, self._state.version + 1, done=True)

    def read(self) -> LiveText:
        return self._state  # one immutable record, swapped whole


class LiveReplies:
    """The replies pages wait for, by their id; the oldest are forgotten past KEPT_REPLIES."""

    def __init__(self, kept: int = KEPT_REPLIES) -> None:
        self._replies: OrderedDict[str, LiveReply] = OrderedDict()
        self._lock = threading.Lock()
        self._kept = kept

    def open(self, reply_id: str | None) -> LiveReply | None:
        """A new reply under `reply_id`, or None when it is not an id the page makes (a script's call, an
        old page): that reply goes through Gradio's updates as before. An id opened before is refused too."""
        if not isinstance(reply_id, str) or not REPLY_ID.fullmatch(reply_id):
            return None
        with self._lock:
            if reply_id in self._replies:
                return None
            reply = self._replies[reply_id] = LiveReply()
            while len(self._replies) > self._kept:
                self._replies.popitem(last=False)[1].finish()
        return reply

    def find(self, reply_id: str) -> LiveReply | None:
        with self._lock:
            return self._replies.get(reply_id)
