"""Where each page of a PDF or DOCX begins in its converted text, so passages can say which page they are on.

    starts = page_starts(document, data)   # [0, 2374, 4822, ...] or None (no pages known: use line numbers)

The converter keeps the text, not the page boundaries, so they are found again from the file's bytes: a
PDF's pages are read again and each is located, in order, by its first words (whatever the converter's
cleaning did to the spaces and line breaks between them); a DOCX's paragraphs are read from
word/document.xml with the page breaks Word recorded when it last laid the file out
(`w:lastRenderedPageBreak`) and the hard ones (`w:br w:type="page"`), and each page starts where its first
paragraph is found in the text.
"""

from __future__ import annotations

import io
import re
import threading
import zipfile
from xml.etree import ElementTree

from documents.document import Document

_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_LOCATE_WORDS = 12  # a page or paragraph is found by its first words: enough to be unique in order
_WORD = re.compile(r"[^\W_]+")
try:  # where PDFium runs in this process for conversions too, share the converter's lock (it is not thread-safe)
    from documents.convert import _PDFIUM_LOCK
except ImportError:  # conversions run elsewhere (an isolated process): a lock for this module's own use
    _PDFIUM_LOCK = threading.Lock()


def page_starts(document: Document, data: bytes | None) -> list[int] | None:
    """Character offsets of each page's start in `document.text` (the first 0), or None where unknown."""
    if not data:
        return None
    if document.kind == "pdf":
        return pdf_page_starts(document, data)
    if document.kind == "docx":
        return docx_page_starts(document, data)
    return None


def pdf_page_starts(document: Document, data: bytes) -> list[int] | None:
    """Where each page of the PDF `data` begins in `document.text` (made from the same bytes by the
    converter), found by reading the pages' text again; None where they cannot all be placed."""
    import pypdfium2

    with _PDFIUM_LOCK:
        pdf = pypdfium2.PdfDocument(data)
        try:
            page_texts = []
            for index in range(len(pdf)):
                page = pdf[index]
                text_page = page.get_textpage()
                page_texts.append(text_page.get_text_range())
                text_page.close()
                page.close()
        finally:
            pdf.close()
    starts, cursor = [], 0
    for page_text in page_texts:
        found = _find_words(document.text, page_text, cursor)
        if found is None:
            return None
        starts.append(found if starts else 0)
        cursor = found
    return starts


def _find_words(text: str, piece: str, cursor: int) -> int | None:
    """Where the first words of `piece` stand in `text` from `cursor` on, whatever whitespace, line breaks or
    control characters the converter's cleaning changed between them (`cursor` for a piece with no words)."""
    words = _WORD.findall(piece)[:_LOCATE_WORDS]
    if not words:
        return cursor
    found = re.compile(r"\W+".join(map(re.escape, words))).search(text, cursor)
    return found.start() if found else None


def docx_page_starts(document: Document, data: bytes) -> list[int] | None:
    """Page starts from the DOCX's recorded page breaks; None where it has none (or they cannot be placed)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive, archive.open("word/document.xml") as xml:
            paragraphs = _docx_paragraphs(xml)
    except (KeyError, zipfile.BadZipFile, ElementTree.ParseError):
        return None
    if not any(page > 1 for page, _ in paragraphs):
        return None
    starts, cursor = [0], 0
    for page, text in paragraphs:
        found = _find_words(document.text, text, cursor) if text else None
        if found is None:
            continue
        while len(starts) < page:  # pages with no text of their own start where the next one does
            starts.append(found)
        cursor = found
    return starts if len(starts) > 1 else None


def _docx_paragraphs(xml) -> list[tuple[int, str]]:
    """(page it starts on, its text) per paragraph of word/document.xml, streamed."""
    paragraphs, parts, page, starts_on = [], [], 1, 1
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
