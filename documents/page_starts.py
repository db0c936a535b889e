"""Where each page of a PDF or DOCX begins in its converted text, so passages can say which page they are on.

    starts = page_starts(document, data)   # [0, 2374, 4822, ...] or None (no pages known: use line numbers)

The converter keeps the text, not the page boundaries, so they are found again from the file's bytes: a
PDF's pages are read again with the converter's own cleaning and located in order in the text; a DOCX's
paragraphs are read from word/document.xml with the page breaks Word recorded when it last laid the file
out (`w:lastRenderedPageBreak`) and the hard ones (`w:br w:type="page"`), and each page starts where its
first paragraph is found in the text.
"""

from __future__ import annotations

import io
import zipfile
from xml.etree import ElementTree

from documents.document import Document

_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_LOCATE_CHARS = 60  # a paragraph is found by its beginning: enough to be unique, short enough to survive layout


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
    """Where each page of the PDF `data` begins in `document.text` (made from the same bytes by
    `convert_bytes`), found by reading the pages' text again; None where they cannot all be placed."""
    import pypdfium2

    from documents.convert import _PDFIUM_LOCK, _clean, _collapse_blank_lines

    with _PDFIUM_LOCK:
        pdf = pypdfium2.PdfDocument(data)
        try:
            page_texts = []
            for index in range(len(pdf)):
                page = pdf[index]
                text_page = page.get_textpage()
                page_texts.append(_collapse_blank_lines(_clean(text_page.get_text_range())))
                text_page.close()
                page.close()
        finally:
            pdf.close()
    starts, cursor = [], 0
    for page_text in page_texts:
        found = document.text.find(page_text, cursor) if page_text else cursor
        if found < 0:
            return None
        starts.append(found if starts else 0)
        cursor = found + len(page_text)
    return starts


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
        found = document.text.find(text[:_LOCATE_CHARS], cursor) if text else -1
        if found < 0:
            continue
        while len(starts) < page:  # pages with no text of their own start where the next one does
            starts.append(found)
        cursor = found + min(len(text), _LOCATE_CHARS)
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
