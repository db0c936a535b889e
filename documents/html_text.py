"""HTML to plain text for the model: the visible text with its block structure, nothing else.

Scripts, styles and other non-text content are dropped; headings become Markdown '#' lines, list
items '- ' lines and table cells are joined with ' | ', because small models read Markdown well.
Built on the standard library's tolerant `html.parser` (it treats script and style bodies as raw
text, as browsers do), so broken HTML still gives its text.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

_DROPPED = {"script", "style", "noscript", "template", "svg", "math", "iframe", "object", "canvas"}
# <head> itself is not dropped: its only text is <title> (its scripts and styles are dropped above), and
# sloppy pages that never close it would lose their body.
_BLOCKS = {
    "address", "article", "aside", "blockquote", "dd", "details", "div", "dl", "dt", "fieldset",
    "figcaption", "figure", "footer", "form", "header", "hr", "main", "nav", "ol", "p", "pre",
    "section", "summary", "table", "title", "ul",
}
_CELLS = {"td", "th"}
_HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
_WHITESPACE_RUN = re.compile(r"\s+")
_BLANK_LINE_RUN = re.compile(r"\n{3,}")


class TextTooLong(ValueError):
    """The page's text passed the limit given to `html_to_text`; the rest of it was not read."""


def html_to_text(html: str, max_chars: int | None = None) -> str:
    """The page's text; with `max_chars`, raises `TextTooLong` as soon as more than that has been written
    (so a huge page costs no more than its first `max_chars` characters of output)."""
    collector = _TextCollector(max_chars)
    collector.feed(html)
    collector.close()
    return collector.text()


class _TextCollector(HTMLParser):
    """Every step costs time in proportion to its own input: the last character written is kept, never
    looked for (a search back over parts made 80,000 whitespace-only nodes quadratic)."""

    def __init__(self, max_chars: int | None = None) -> None:
        super().__init__(convert_charrefs=True)
        self._parts: list[str] = []
        self._chars = 0
        self._max_chars = max_chars
        self._last = "\n"  # the last character written so far; a newline at the start
        self._dropped_depth = 0
        self._pre_depth = 0
        self._cell_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _DROPPED:
            self._dropped_depth += 1
        if self._dropped_depth:
            return
        if tag in _BLOCKS and self._cell_depth:
            self._append_space()  # a table row stays one line, even with paragraphs in its cells
        elif tag in _BLOCKS:
            self._write("\n\n")
        elif tag in _HEADINGS:
            self._write("\n\n" + "#" * _HEADINGS[tag] + " ")
        elif tag == "li":
            self._write("\n- ")
        elif tag in ("br", "tr"):
            self._write("\n")
        elif tag in _CELLS:
            if not self._at_line_start():
                self._trim_trailing_space()
                self._write(" | ")
            self._cell_depth += 1
        if tag == "pre":
            self._pre_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in _DROPPED:
            self._dropped_depth = max(0, self._dropped_depth - 1)
            return
        if self._dropped_depth:
            return
        if tag in _CELLS:
            self._cell_depth = max(0, self._cell_depth - 1)
        elif self._cell_depth and (tag in _BLOCKS or tag in _HEADINGS):
            self._append_space()
        elif tag in _BLOCKS or tag in _HEADINGS:
            self._write("\n\n")
        if tag == "pre":
            self._pre_depth = max(0, self._pre_depth - 1)

    def handle_data(self, data: str) -> None:
        if self._dropped_depth:
            return
        if self._pre_depth:
            self._write(data)
            return
        collapsed = _WHITESPACE_RUN.sub(" ", data)
        if self._last_char() in "\n ":
            collapsed = collapsed.lstrip()
        self._write(collapsed)

    def _write(self, part: str) -> None:
        if not part:
            return
        self._parts.append(part)
        self._last = part[-1]
        self._chars += len(part)
        if self._max_chars is not None and self._chars > self._max_chars:
            raise TextTooLong(self._chars)

    def _last_char(self) -> str:
        return self._last

    def _at_line_start(self) -> bool:
        return self._last_char() == "\n"

    def _append_space(self) -> None:
        if self._last_char() not in "\n ":
            self._write(" ")

    def _trim_trailing_space(self) -> None:
        while self._parts and self._parts[-1].endswith(" "):
            kept = self._parts[-1].rstrip(" ")
            self._chars -= len(self._parts[-1]) - len(kept)
            self._parts[-1] = kept
            if not kept:
                self._parts.pop()
        self._last = self._parts[-1][-1] if self._parts else "\n"

    def text(self) -> str:
        lines = "".join(self._parts).split("\n")
        joined = "\n".join(line.rstrip() for line in lines)
        return _BLANK_LINE_RUN.sub("\n\n", joined).strip()
