"""A file's bytes to a `Document`, in this process, stopping at every bound of `ConversionLimits` that can be
checked as the work goes: the text's length (each converter counts what it has produced and stops as soon
as it passes the limit), a DOCX's unpacked bytes, XML elements and text (counted while streaming through
expat, before mammoth builds a tree of them: documents/docx_scan.py), a PDF's pages. What cannot be counted from here (PDFium inflating a stream, a
parser's own memory) is bounded by the worker process that runs this (documents/isolation.py).

PDF text comes from pypdfium2 (PDFium, the PDF engine of Chrome), DOCX through mammoth (DOCX to HTML),
HTML through the standard library's parser; text files are read as UTF-8 (or BOM-marked UTF-16). The
libraries are imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile

from documents.document import Document, DocumentError
from documents.docx_scan import scan_docx
from documents.html_text import TextTooLong, html_to_text
from documents.limits import ConversionLimits
from documents.page_starts import docx_page_starts, pdf_page_starts
from documents.sniff import detect_kind

_LINE_BREAKS = re.compile(r"\r\n?|[\f\v\x85\u2028\u2029]")
# Controls other than tab and newline carry nothing for the model (PDFium marks soft hyphens with \x02).
_STRAY_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff\ufffe]")
_BLANK_LINE_RUN = re.compile(r"\n{3,}")
_DOCX_PAGES = re.compile(rb"<(?:\w+:)?Pages>\s*(\d+)\s*</(?:\w+:)?Pages>")
_READ_BLOCK = 2**20


def extract_document(name: str, data: bytes, limits: ConversionLimits) -> Document:
    """`name` is already a display name (convert.attachment_name) and `data` within `limits.file_bytes`."""
    kind = detect_kind(name, data, limits.unzipped_bytes)
    pages: int | None = None
    starts: list[int] | None = None
    if kind == "pdf":
        page_texts = _pdf_page_texts(name, data, limits)
        text, pages = _collapse_blank_lines("\n\n".join(page_texts)), len(page_texts)
        starts = pdf_page_starts(text, page_texts)
    elif kind == "docx":
        text, pages = _docx_text(name, data, limits)
        starts = docx_page_starts(text, data)
    elif kind == "html":
        text = _collapse_blank_lines(_clean(_html_text(name, _decode_text(data), limits)))
    else:
        text = _decode_text(data)
        check_text_length(name, len(text), limits)  # before cleaning copies it
        text = _clean(text)
    if not text.strip():
        raise DocumentError(f"{name} contains no text. Attach a file with text in it.")
    check_text_length(name, len(text), limits)
    return Document(name=name, kind=kind, text=text, sha256=hashlib.sha256(data).hexdigest(),
                    size_bytes=len(data), pages=pages, page_starts=tuple(starts) if starts else None)


def check_text_length(name: str, chars: int, limits: ConversionLimits) -> None:
    if chars > limits.text_chars:
        raise too_much_text(name, limits)


def too_much_text(name: str, limits: ConversionLimits) -> DocumentError:
    return DocumentError(f"{name} holds more than {limits.text_chars:,} characters of text, more than an "
                         f"attachment may. Attach the part you need, or split the file.")


def _html_text(name: str, html: str, limits: ConversionLimits) -> str:
    try:
        return html_to_text(html, limits.text_chars)
    except TextTooLong:
        raise too_much_text(name, limits) from None


def _pdf_page_texts(name: str, data: bytes, limits: ConversionLimits) -> list[str]:
    import pypdfium2

    try:
        pdf = pypdfium2.PdfDocument(data)
    except pypdfium2.PdfiumError as error:
        if error.err_code == pypdfium2.raw.FPDF_ERR_PASSWORD:
            raise DocumentError(
                f"{name} is password-protected. Remove the password (open it and save or print it "
                f"as a new PDF) and attach it again."
            ) from None
        raise _damaged_pdf(name) from None
    try:
        page_count = len(pdf)
        if page_count > limits.pdf_pages:
            raise DocumentError(f"{name} has {page_count:,} pages; attachments may have at most "
                                f"{limits.pdf_pages:,}. Attach the pages you need.")
        page_texts, chars = [], 0
        for index in range(page_count):
            page_text = _page_text(name, pdf, index, limits.text_chars - chars, limits)
            page_texts.append(page_text)
            chars += len(page_text)
            check_text_length(name, chars, limits)  # stop early rather than extract a huge PDF in full
    finally:
        pdf.close()
    if not any(text.strip() for text in page_texts):
        raise DocumentError(
            f"{name}: this PDF has no text layer (scanned pages?); OCR it first (for example with "
            f"ocrmypdf) and attach the result."
        )
    return page_texts


def _page_text(name: str, pdf, index: int, chars_left: int, limits: ConversionLimits) -> str:
    import pypdfium2

    try:  # a page tree that loops or nests thousands deep fails here, not when the file opens
        page = pdf[index]
        text_page = page.get_textpage()
    except pypdfium2.PdfiumError:
        raise _damaged_pdf(name, f" (page {index + 1} cannot be read)") from None
    try:
        if text_page.count_chars() > chars_left:  # counted before a string of them is built
            raise too_much_text(name, limits)
        return _clean(text_page.get_text_range())
    finally:
        text_page.close()
        page.close()


def _damaged_pdf(name: str, where: str = "") -> DocumentError:
    return DocumentError(f"{name} could not be read as a PDF{where}; it may be damaged. "
                         f"Open and save it again, or attach it in another format.")


def _docx_text(name: str, data: bytes, limits: ConversionLimits) -> tuple[str, int | None]:
    import mammoth

    scan_docx(name, data, limits)  # streamed to its first bound before mammoth holds any part whole
    try:
        html = mammoth.convert_to_html(io.BytesIO(data)).value
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001  a damaged DOCX fails inside mammoth with zip, XML, key or recursion errors
        raise DocumentError(f"{name} could not be read as a Word document (it may be damaged). "
                            f"Open and save it again, or attach it as PDF.") from None
    return _collapse_blank_lines(_clean(_html_text(name, html, limits))), _docx_page_count(data)


def _docx_page_count(data: bytes) -> int | None:
    """The page count Word recorded when it last saved the file, where it did."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            with archive.open("docProps/app.xml") as member:
                app_properties = member.read(_READ_BLOCK)  # the count is near the start; a bomb stops here
    except (KeyError, zipfile.BadZipFile):
        return None
    match = _DOCX_PAGES.search(app_properties)
    pages = int(match.group(1)) if match else 0
    return pages if pages > 0 else None


def _decode_text(data: bytes) -> str:
    """UTF-8 (a BOM is dropped) or BOM-marked UTF-16; `detect_kind` has already refused anything else."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16")
    return data.decode("utf-8-sig")


def _clean(text: str) -> str:
    """One newline convention, no stray controls, no trailing spaces: the same file, the same text."""
    text = _STRAY_CONTROLS.sub("", _LINE_BREAKS.sub("\n", text))
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def _collapse_blank_lines(text: str) -> str:
    return _BLANK_LINE_RUN.sub("\n\n", text)
