"""What a file really is, judged by its bytes; the name only says what the user expects.

A name ending in .pdf or .docx must hold that format, .html/.htm/.xhtml must hold text, and any other
extension means text (Markdown, source code, CSV...). A name without an extension (a download that
lost it) is taken for whatever its content is. Anything else is a `DocumentError` that names both.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import PurePath
from typing import cast

from documents.document import DocumentError, DocumentKind
from documents.limits import MAX_UNZIPPED_BYTES

SUPPORTED = "plain text, Markdown, source code, HTML, PDF or Word (.docx)"

_PDF_MAGIC = b"%PDF-"
_PDF_HEADER_WINDOW = 1024  # the PDF specification lets the header start anywhere in the first 1 KiB
_ZIP_MAGIC = b"PK\x03\x04"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_HTML_EXTENSIONS = {".html", ".htm", ".xhtml"}
# Only to name a file's real type in an error message; detection does not depend on this table.
_KNOWN_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"RIFF", "a media file (WebP, WAV or AVI)"),
    (b"\x7fELF", "a program (ELF executable)"),
    (b"MZ", "a Windows program"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!", "a RAR archive"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1",
     "an old-style Office file (.doc, .xls, .ppt) or a password-protected Office document"),
    (_ZIP_MAGIC, "a zip archive"),
    (_PDF_MAGIC, "a PDF"),
)
_OFFICE_ZIP_PARTS = (
    ("xl/workbook.xml", "an Excel workbook"),
    ("ppt/presentation.xml", "a PowerPoint presentation"),
    ("content.xml", "an OpenDocument file"),
)
_KIND_LABELS = {"pdf": "a PDF", "docx": "a Word (.docx) document", "html": "an HTML page", "text": "text"}


def expected_kind(name: str) -> DocumentKind | None:
    """The kind the file's name promises; None for a name without an extension."""
    suffix = PurePath(name).suffix.lower()
    if not suffix:
        return None
    if suffix == ".pdf":
        return "pdf"
    if suffix == ".docx":
        return "docx"
    if suffix in _HTML_EXTENSIONS:
        return "html"
    return "text"


def detect_kind(name: str, data: bytes, max_unzipped_bytes: int = MAX_UNZIPPED_BYTES) -> DocumentKind:
    """The file's kind from its content, checked against its name; raises `DocumentError`. A DOCX's members
    must declare at most `max_unzipped_bytes` in all (zipfile never unpacks a member past its declared size)."""
    expected = expected_kind(name)
    actual = _content_kind(data)
    if expected in ("pdf", "docx") and actual != expected:
        raise _mismatch(name, expected, data)
    if actual == "binary":
        raise DocumentError(
            f"{name} cannot be attached: its content is {describe(data)}, not text. Attach {SUPPORTED}."
        )
    if actual == "legacy-text":
        raise DocumentError(
            f"{name} is not UTF-8 text (it is in an older encoding such as Latin-1 or Windows-1252). "
            f"Save it as UTF-8 and attach it again."
        )
    if actual == "zip" and expected in (None, "text"):
        raise DocumentError(
            f"{name} cannot be attached: its content is {describe(data)}. Attach {SUPPORTED} "
            f"(a spreadsheet or presentation can be saved as PDF; an archive, unpacked)."
        )
    if expected is None:
        # binary, legacy text and a zip that is no DOCX were refused above: what is left is a DocumentKind
        return "html" if actual == "text" and _looks_like_html(data) else cast(DocumentKind, actual)
    if expected == "html" and actual == "text":
        return "html"
    if expected != actual:
        raise _mismatch(name, expected, data)
    if actual == "docx":
        _check_unpacked_size(name, data, max_unzipped_bytes)
    return actual


def _mismatch(name: str, expected: DocumentKind, data: bytes) -> DocumentError:
    return DocumentError(
        f"{name} is not {_KIND_LABELS[expected]}: its content is {describe(data)}. "
        f"Attach the original file, or give it the extension that matches its content."
    )


def describe(data: bytes) -> str:
    """A reader's name for what the bytes are, for error messages."""
    kind = _content_kind(data)
    if kind in _KIND_LABELS:
        return _KIND_LABELS[kind]
    if kind == "zip":
        names = _zip_names(data)
        for part, label in _OFFICE_ZIP_PARTS:
            if part in names:
                return label
    for magic, label in _KNOWN_MAGIC:
        if data.startswith(magic):
            return label
    return {"binary": "binary data", "legacy-text": "text in an older encoding than UTF-8"}.get(kind, kind)


def _content_kind(data: bytes) -> str:
    """'pdf', 'docx', 'text', or what stops it: 'zip' (another zip), 'binary', 'legacy-text'."""
    if _PDF_MAGIC in data[:_PDF_HEADER_WINDOW]:
        return "pdf"
    if data.startswith(_ZIP_MAGIC):
        return "docx" if "word/document.xml" in _zip_names(data) else "zip"
    if data.startswith(_UTF16_BOMS):
        try:
            data.decode("utf-16")
        except UnicodeDecodeError:
            return "binary"
        return "text"
    if b"\x00" in data or _control_bytes(data) > max(2, len(data) // 1000):
        return "binary"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "legacy-text"
    return "text"


def _control_bytes(data: bytes) -> int:
    """C0 control bytes other than tab, newlines, form feed and escape: rare in text, common in binaries."""
    return len(data) - len(data.translate(None, _CONTROL_BYTES))


# ESC stays allowed: logs with ANSI colours are text.
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f\x1b")


def _zip_names(data: bytes) -> set[str]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return set(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return set()


def _check_unpacked_size(name: str, data: bytes, most: int) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        unpacked = sum(info.file_size for info in archive.infolist())
    if unpacked > most:
        raise DocumentError(
            f"{name} unpacks to {unpacked / 2**20:,.0f} MB, more than the {most / 2**20:,.0f} MB "
            f"a Word document may hold. Attach a smaller document, or save it as PDF."
        )


def _looks_like_html(data: bytes) -> bool:
    start = data[:512].decode("utf-8-sig", errors="ignore").lstrip().lower()
    return start.startswith(("<!doctype html", "<html"))
