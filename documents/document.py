"""What an attached file becomes: a `Document` (its text for the model plus facts for its card).

Every field is checked in `Document.__post_init__`, so any `Document` that exists is one the prompt
and the card can use as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Protocol

DocumentKind = Literal["pdf", "docx", "html", "text"]
DOCUMENT_KINDS: tuple[str, ...] = ("pdf", "docx", "html", "text")

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# The name goes into a one-line prompt header and a one-line card: no line breaks or other controls.
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


class DocumentError(ValueError):
    """A file that cannot be attached; the message is written for the user and says what to do."""


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that the card needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Document:
    """An attached file, converted once: `text` is what the model reads (see `documents.prompt`).

    `pages` is known for PDFs (always) and DOCX files (when the saving program recorded it);
    `lines` counts the lines of `text` for every kind. `page_starts` says where each page begins in `text`
    (found by the converter, for a PDF or a DOCX with recorded page breaks), so passages can name their page.
    `read` is set on a document read by passages (documents.reading): what of it `text` holds,
    'report.pdf: pages 1, 36-38'; None: `text` is the whole document.
    """

    name: str
    kind: DocumentKind
    text: str = field(repr=False)  # up to MAX_TEXT_CHARS: too long for logs
    sha256: str  # of the original file's bytes, so the same file is recognised whatever its text
    size_bytes: int
    pages: int | None = None
    # found again from the file's bytes only, so a document rebuilt from a stored message has none: not compared
    page_starts: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    read: str | None = None

    def __post_init__(self) -> None:
        if not self.name or _CONTROL_CHARACTERS.search(self.name) or '"' in self.name:
            raise ValueError(f"document name must be one line without quotes: {self.name!r}")
        if self.kind not in DOCUMENT_KINDS:
            raise ValueError(f"document kind must be one of {DOCUMENT_KINDS}, got {self.kind!r}")
        if not self.text.strip():
            raise ValueError("document text must not be empty")
        if not _SHA256_HEX.fullmatch(self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if self.size_bytes <= 0:
            raise ValueError(f"size_bytes must be positive, got {self.size_bytes}")
        if self.pages is not None and self.pages < 1:
            raise ValueError(f"pages must be None or positive, got {self.pages}")
        starts = self.page_starts
        if starts is not None and (not starts or starts[0] != 0 or list(starts) != sorted(starts)
                                   or starts[-1] > len(self.text)):
            raise ValueError("page_starts must begin at 0 and rise within the text")
        if self.read is not None and (not self.read or _CONTROL_CHARACTERS.search(self.read)):
            raise ValueError(f"read must be one line saying what was read, got {self.read!r}")

    @property
    def lines(self) -> int:
        return self.text.count("\n") + 1

    def extent(self) -> str:
        """'12 pages' where the page count is known, else '340 lines'."""
        if self.pages is not None:
            return _plural(self.pages, "page")
        return _plural(self.lines, "line")

    def card(self, tokenizer: Tokenizer | None = None) -> str:
        """One line for the chat's file card: 'report.pdf · 12 pages · 6,031 tokens'.

        Tokens are those of the text the model reads (`attachment_text`), counted with the model's
        own tokenizer; without one the card gives characters instead.
        """
        from documents.prompt import attachment_text  # the prompt module builds on this one

        prompt_text = attachment_text(self)
        if tokenizer is None:
            size = _plural(len(prompt_text), "character")
        else:
            size = _plural(len(tokenizer.encode(prompt_text, add_special_tokens=False)), "token")
        return f"{self.name} · {self.extent()} · {size}"


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"
