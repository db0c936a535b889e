"""A converted document cut into passages that each say where they come from (pages or lines).

    passages = split_passages(document, page_starts=page_starts(document, data))  # PDF, DOCX: pages kept
    passages = split_passages(document)                 # text, HTML: line numbers
    describe_read(document.name, passages[:1] + passages[40:42])   # 'report.pdf: pages 1, 36-37'

A passage is a run of whole paragraphs (blank-line separated) of about `passage_tokens` tokens, never
across a page boundary; a paragraph longer than that is cut at line ends, and a line longer still at
spaces. Token counts here are estimates (4 characters a token, about what the default tokenizer gives for
English prose): they decide where to cut, not what fits the window, which the caller counts with the model's
tokenizer.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from documents.document import Document

CHARS_PER_TOKEN = 4
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class Passage:
    index: int  # its place in the document, from 0
    text: str
    first_line: int  # 1-based, in the document's text
    last_line: int
    page: int | None = None  # 1-based; None where the document has no page boundaries

    def __post_init__(self) -> None:
        if self.index < 0 or not self.text.strip():
            raise ValueError("a passage has a non-negative index and some text")
        if not 1 <= self.first_line <= self.last_line:
            raise ValueError(f"passage lines must run forward from 1: {self.first_line}-{self.last_line}")
        if self.page is not None and self.page < 1:
            raise ValueError(f"page numbers start at 1, got {self.page}")

    @property
    def location(self) -> str:
        """'page 36' or 'lines 840-861': how the model and the user are told where it stood."""
        if self.page is not None:
            return f"page {self.page}"
        if self.first_line == self.last_line:
            return f"line {self.first_line}"
        return f"lines {self.first_line}-{self.last_line}"


def split_passages(document: Document, passage_tokens: int = 200,
                   page_starts: Sequence[int] | None = None) -> list[Passage]:
    """The document's passages in order. `page_starts`: where each page begins in `document.text` (character
    offsets, the first 0), as `documents.page_starts.page_starts` finds them; without it passages carry line numbers only."""
    if passage_tokens < 8:
        raise ValueError(f"passage_tokens must be at least 8, got {passage_tokens}")
    text, limit = document.text, passage_tokens * CHARS_PER_TOKEN
    starts = list(page_starts) if page_starts else [0]
    if starts[0] != 0 or starts != sorted(starts) or starts[-1] > len(text):
        raise ValueError("page_starts must begin at 0 and rise within the text")
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    passages: list[Passage] = []
    bounds = starts + [len(text)]
    for page_number, (begin, end) in enumerate(itertools.pairwise(bounds), start=1):
        for piece_start, piece_end in _pieces(text, begin, end, limit):
            body = text[piece_start:piece_end]
            stripped = body.strip()
            if not stripped:
                continue
            first = piece_start + (len(body) - len(body.lstrip()))
            last = first + len(stripped) - 1
            passages.append(Passage(
                index=len(passages), text=stripped, first_line=bisect.bisect_right(line_starts, first),
                last_line=bisect.bisect_right(line_starts, last), page=page_number if page_starts else None))
    return passages


def _pieces(text: str, begin: int, end: int, limit: int) -> list[tuple[int, int]]:
    """(start, end) spans covering text[begin:end]: whole paragraphs joined up to `limit` characters."""
    units = []
    for start, stop in _paragraph_spans(text, begin, end):
        units.extend(_cut(text, start, stop, limit))
    pieces: list[tuple[int, int]] = []
    for start, stop in units:
        if pieces and stop - pieces[-1][0] <= limit:
            pieces[-1] = (pieces[-1][0], stop)
        else:
            pieces.append((start, stop))
    return pieces


def _paragraph_spans(text: str, begin: int, end: int) -> list[tuple[int, int]]:
    spans, at = [], begin
    for match in _PARAGRAPH_BREAK.finditer(text, begin, end):
        spans.append((at, match.start()))
        at = match.end()
    spans.append((at, end))
    return [(s, e) for s, e in spans if text[s:e].strip()]


def _cut(text: str, start: int, stop: int, limit: int) -> list[tuple[int, int]]:
    """A paragraph longer than `limit` cut at the last line end (else space, else anywhere) before it."""
    spans = []
    while stop - start > limit:
        window = text[start:start + limit]
        cut = window.rfind("\n")
        if cut < limit // 4:
            cut = window.rfind(" ")
        if cut < limit // 4:
            cut = limit
        spans.append((start, start + cut))
        start += cut
    spans.append((start, stop))
    return spans


def describe_read(name: str, passages: Sequence[Passage]) -> str:
    """What was read of a file, ranges merged: 'report.pdf: pages 1, 36-38' or 'notes.txt: lines 1-12, 840-861'."""
    if not passages:
        return f"{name}: nothing"
    pages = [p.page for p in passages if p.page is not None]
    if len(pages) == len(passages):
        ranges = _merged([(page, page) for page in pages], gap=1)
        unit = "page" if len(ranges) == 1 and ranges[0][0] == ranges[0][1] else "pages"
    else:
        ranges = _merged([(p.first_line, p.last_line) for p in passages], gap=2)  # a blank line between
        unit = "line" if len(ranges) == 1 and ranges[0][0] == ranges[0][1] else "lines"
    return f"{name}: {unit} " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _merged(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    return merged
