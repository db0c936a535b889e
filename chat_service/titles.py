"""The one rule that names a new session after its first message, for the page and the API alike.

    session_title("What is the capital of France?\nThanks")        # 'What is the capital of France?'
    session_title("", [report])                                     # 'About report.pdf'
"""

from __future__ import annotations

from collections.abc import Sequence

from documents import Document

TITLE_CHARACTERS = 60  # what the sidebar's details show of a title


def session_title(question: str, attachments: Sequence[Document] = (), default: str = "New chat") -> str:
    """The first line of the question; a message that is only files is named after the first; else `default`."""
    lines = question.strip().splitlines()
    if lines:
        return lines[0].strip()[:TITLE_CHARACTERS]
    if attachments:
        return f"About {attachments[0].name}"[:TITLE_CHARACTERS]
    return default
