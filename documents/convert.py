"""Turn an attached file into a `Document`: check it, then detect its kind and extract its text in a bounded
worker process.

    document = convert_file("/tmp/gradio/abc/report.pdf")
    document.card(tokenizer)   # 'report.pdf · 12 pages · 6,031 tokens'

Every problem with the file is a `DocumentError` whose message tells the user what to do, including a file
that would take more memory or time than `ConversionLimits` allow (documents/isolation.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from pathlib import Path, PurePath

from documents.document import Document, DocumentError
from documents.extract import extract_document
from documents.isolation import run_bounded
from documents.limits import DEFAULT_LIMITS, ConversionLimits

# A file system's longest name; the name goes into the prompt, so a longer one only costs tokens.
MAX_NAME_CHARS = 255
# controls, quotes and markup: the name sits inside `<document name="...">` in the prompt and on the card
_NAME_UNSAFE = re.compile(r'[\x00-\x1f\x7f"<>&`]')
_HASH_BLOCK = 2**20


def convert_file(path: str | os.PathLike[str], name: str | None = None,
                 limits: ConversionLimits = DEFAULT_LIMITS) -> Document:
    """Read and convert the file at `path`; `name` (default: the path's file name) is what the user sees."""
    path = Path(path)
    display_name = attachment_name(name if name is not None else path.name)
    _check_size(display_name, path.stat().st_size, limits)  # before reading: a huge file never enters memory
    return convert_bytes(display_name, path.read_bytes(), limits)


def convert_bytes(name: str, data: bytes, limits: ConversionLimits = DEFAULT_LIMITS) -> Document:
    """Convert a file's bytes; `name` is the file name the user gave it (a path is cut to its name)."""
    name = attachment_name(name)
    _check_size(name, len(data), limits)
    return run_bounded(extract_document, (name, data, limits), limits, name)


def attachment_digest(path: str | os.PathLike[str], limits: ConversionLimits = DEFAULT_LIMITS) -> str:
    """The SHA-256 of an attached file, its size checked first and its bytes read a block at a time, so a file
    too large to attach costs no memory (the page keys its conversions by this)."""
    path = Path(path)
    _check_size(attachment_name(path.name), path.stat().st_size, limits)
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def attachment_name(name: str) -> str:
    """The file name as shown and put in the prompt: no folders, line breaks, quotes, markup characters or
    bidirectional controls (which make 'exe.txt' display as 'txt.exe'), at most MAX_NAME_CHARS characters
    (the end kept, as it holds the extension)."""
    base = PurePath(name.replace("\\", "/")).name
    visible = "".join(character for character in base if unicodedata.category(character) != "Cf")
    cleaned = _NAME_UNSAFE.sub("_", visible).strip()
    if len(cleaned) > MAX_NAME_CHARS:
        stem, suffix = os.path.splitext(cleaned)
        suffix = suffix if len(suffix) < 16 else ""
        cleaned = stem[:MAX_NAME_CHARS - len(suffix) - 1] + "…" + suffix
    return cleaned or "attachment"


def _check_size(name: str, size: int, limits: ConversionLimits) -> None:
    if size == 0:
        raise DocumentError(f"{name} is empty. Attach a file with text in it.")
    if size > limits.file_bytes:
        raise DocumentError(
            f"{name} is {size / 2**20:,.1f} MB; attachments may be at most {limits.file_bytes // 2**20} MB. "
            f"Attach the part you need, or split the file."
        )
