"""Turn an attached file into a `Document`: check it, detect its kind, extract its text.

    document = convert_file("/tmp/gradio/abc/report.pdf")
    document.card(tokenizer)   # 'report.pdf · 12 pages · 6,031 tokens'

PDF text comes from pypdfium2 (PDFium, the PDF engine of Chrome), DOCX through mammoth (DOCX to
HTML), HTML through the standard library's parser; text files are read as UTF-8 (or BOM-marked
UTF-16). The libraries are imported on first use, so importing this module stays cheap.
Every problem with the file is a `DocumentError` whose message tells the user what to do.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
import zipfile
from pathlib import Path, PurePath

from documents.document import Document, DocumentError
from documents.html_text import html_to_text
from documents.sniff import detect_kind

# Checked before anything is parsed: 20 MB holds a book-length PDF; more is rarely text at all.
MAX_FILE_BYTES = 20 * 1024 * 1024
# About 500,000 tokens, far beyond the model's window already; beyond it a file is data, not reading.
MAX_TEXT_CHARS = 2_000_000

# PDFium is not thread-safe and Gradio runs handlers in threads: one conversion at a time.
_PDFIUM_LOCK = threading.Lock()
_NAME_UNSAFE = re.compile(r'[\x00-\x1f\x7f"]')
_LINE_BREAKS = re.compile(r"\r\n?|[\f\v\x85\u2028\u2029]")
# Controls other than tab and newline carry nothing for the model (PDFium marks soft hyphens with \x02).
_STRAY_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff\ufffe]")
_BLANK_LINE_RUN = re.compile(r"\n{3,}")
_DOCX_PAGES = re.compile(rb"<(?:\w+:)?Pages>\s*(\d+)\s*</(?:\w+:)?Pages>")

def convert_file(path: str | os.PathLike[str], name: str | None = None) -> Document:
    """Read and convert the file at `path`; `name` (default: the path's file name) is what the user sees."""
    path = Path(path)
    display_name = attachment_name(name if name is not None else path.name)
    size = path.stat().st_size
    _check_size(display_name, size)  # before reading: a huge file never enters memory
    return convert_bytes(display_name, path.read_bytes())

def convert_bytes(name: str, data: bytes) -> Document:
    """Convert a file's bytes; `name` is the file name the user gave it (a path is cut to its name)."""
    name = attachment_name(name)
    _check_size(name, len(data))
    kind = detect_kind(name, data)
    pages: int | None = None
    if kind == "pdf":
        text, pages = _pdf_text(name, data)
    elif kind == "docx":
        text, pages = _docx_text(name, data)
    elif kind == "html":
        text = _collapse_blank_lines(_clean(html_to_text(_decode_text(data))))
    else:
        text = _clean(_decode_text(data))
    if not text.strip():
        raise DocumentError(f"{name} contains no text. Attach a file with text in it.")
    _check_text_length(name, len(text))
    return Document(name=name, kind=kind, text=text, sha256=hashlib.sha256(data).hexdigest(),
                    size_bytes=len(data), pages=pages)

def attachment_name(name: str) -> str:
    """The file name as shown and put in the prompt: no folders, no line breaks, no quotes."""
    base = PurePath(name.replace("\\", "/")).name
    cleaned = _NAME_UNSAFE.sub("_", base).strip()
    return cleaned or "attachment"

def _check_size(name: str, size: int) -> None:
    if size == 0:
        raise DocumentError(f"{name} is empty. Attach a file with text in it.")
    if size > MAX_FILE_BYTES:
        raise DocumentError(
            f"{name} is {size / 2**20:,.1f} MB; attachments may be at most {MAX_FILE_BYTES // 2**20} MB. "
            f"Attach the part you need, or split the file."
        )

def _check_text_length(name: str, chars: int) -> None:
    if chars > MAX_TEXT_CHARS:
        raise DocumentError(
            f"{name} holds more than {MAX_TEXT_CHARS:,} characters of text, more than an attachment may. "
            f"Attach the part you need, or split the file."
        )

def _pdf_text(name: str, data: bytes) -> tuple[str, int]:
    import pypdfium2

    with _PDFIUM_LOCK:
        try:
            pdf = pypdfium2.PdfDocument(data)
        except pypdfium2.PdfiumError as error:
            if error.err_code == pypdfium2.raw.FPDF_ERR_PASSWORD:
                raise DocumentError(
                    f"{name} is password-protected. Remove the password (open it and save or print it "
                    f"as a new PDF) and attach it again."
                ) from None
            raise DocumentError(f"{name} could not be read as a PDF (it may be damaged). "
                                f"Open and save it again, or attach it in another format.") from None
        try:
            page_texts: list[str] = []
            chars = 0
            for index in range(len(pdf)):
                page = pdf[index]
                text_page = page.get_textpage()
                page_text = _clean(text_page.get_text_range())
                text_page.close()
                page.close()
                page_texts.append(page_text)
                chars += len(page_text)
                _check_text_length(name, chars)  # stop early rather than extract a huge PDF in full
            page_count = len(pdf)
        finally:
            pdf.close()
    if not any(text.strip() for text in page_texts):
        raise DocumentError(
            f"{name}: this PDF has no text layer (scanned pages?); OCR it first (for example with "
            f"ocrmypdf) and attach the result."
        )
    return _collapse_blank_lines("\n\n".join(page_texts)), page_count

def _docx_text(name: str, data: bytes) -> tuple[str, int | None]:
    import mammoth

    try:
        html = mammoth.convert_to_html(io.BytesIO(data)).value
    except Exception:  # a damaged DOCX fails deep inside mammoth with any of zip, XML or key errors
        raise DocumentError(f"{name} could not be read as a Word document (it may be damaged). "
                            f"Open and save it again, or attach it as PDF.") from None
    return _collapse_blank_lines(_clean(html_to_text(html))), _docx_page_count(data)

def _docx_page_count(data: bytes) -> int | None:
    """The page count Word recorded when it last saved the file, where it did."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            app_properties = archive.read("docProps/app.xml")
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

