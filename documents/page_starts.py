"""Where each page of a PDF or DOCX begins in its converted text, so passages can say which page they are on.

    starts = pdf_page_starts(text, page_texts)   # [0, 2374, 4822, ...] or None (then passages use line numbers)
    starts = docx_page_starts(text, data)

Both run inside the converter's bounded worker (documents/extract.py), on what it already has: a PDF's page
texts, each located in order in the final text by its first words (whatever the cleaning did to the spaces
and line breaks between them); a DOCX's paragraphs read from word/document.xml with the page breaks Word
recorded when it last laid the file out (`w:lastRenderedPageBreak`) and the hard ones (`w:br w:type="page"`),
each page starting where its first paragraph is found in the text.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Sequence
from xml.etree import ElementTree

_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_LOCATE_WORDS = 12  # a page or paragraph is found by its first words: enough to be unique in order
_WORD = re.compile(r"[^\W_]+")


def pdf_page_starts(text: str, page_texts: Sequence[str]) -> list[int] | None:
    """Where each of the PDF's pages (their texts as extracted, in order) begins in `text`, the document's
    text made from them; None where they cannot all be placed."""
    starts: list[int] = []
    cursor = 0
    for page_text in page_texts:
        found = _find_words(text, page_text, cursor)
        if found is None:
            return None
        starts.append(found if starts else 0)
        cursor = found
    return starts or None


def _find_words(text: str, piece: str, cursor: int) -> int | None:
    """Where the first words of `piece` stand in `text` from `cursor` on, whatever whitespace, line breaks or
    control characters the converter's cleaning changed between them (`cursor` for a piece with no words)."""
    words = _WORD.findall(piece)[:_LOCATE_WORDS]
    if not words:
        return cursor
    found = re.compile(r"\W+".join(map(re.escape, words))).search(text, cursor)
    return found.start() if found else None


def docx_page_starts(text: str, data: bytes) -> list[int] | None:
    """Page starts from the DOCX's recorded page breaks; None where it has none (or they cannot be placed)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive, archive.open("word/document.xml") as xml:
            paragraphs = _docx_paragraphs(xml)
    except (KeyError, zipfile.BadZipFile, ElementTree.ParseError):
        return None
    if not any(page > 1 for page, _ in paragraphs):
        return None
    starts, cursor = [0], 0
    for page, paragraph in paragraphs:
        found = _find_words(text, paragraph, cursor) if paragraph else None
        if found is None:
            continue
        while len(starts) < page:  # pages with no text of their own start where the next one does
            starts.append(found)
        cursor = found
    return starts if len(starts) > 1 else None


def _docx_paragraphs(xml) -> list[tuple[int, str]]:
    """(page it starts on, its text) per paragraph of word/document.xml, streamed."""
    paragraphs: list[tuple[int, str]] = []
    parts: list[str] = []
    page = starts_on = 1
    for event, element in ElementTree.iterparse(xml, events=("start", "end")):
        tag = element.tag
        if event == "start":
            if tag == _W + "p":
                parts, starts_on = [], page
            elif tag == _W + "lastRenderedPageBreak" or (tag == _W + "br" and element.get(_W + "type") == "page"):
                page += 1
                if not "".join(parts).strip():
                    starts_on = page  # the break comes before any of the paragraph's text
            continue
        if tag == _W + "t":
            parts.append(element.text or "")
        elif tag == _W + "p":
            paragraphs.append((starts_on, "".join(parts).strip()))
            element.clear()
    return paragraphs
