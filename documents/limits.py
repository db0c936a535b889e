"""How much a file may make the converter read, expand, produce and spend: one frozen dataclass, checked here.

    limits = ConversionLimits(seconds=5)          # the defaults, with less time
    convert_bytes("a.pdf", data, limits)

The bounds on what a file expands to (unpacked bytes, XML tags, pages, characters of text) stop a conversion
early with a sentence for the user. Memory and time bound what no check can foresee (a PDF stream that
inflates inside PDFium, a parser's own cost): the conversion runs in a worker process that the operating
system stops at `memory_bytes` of new address space and that is killed after `seconds`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Checked before anything is parsed: 20 MB holds a book-length PDF; more is rarely text at all.
MAX_FILE_BYTES = 20 * 1024 * 1024
# About 500,000 tokens, far beyond the model's window already; beyond it a file is data, not reading.
MAX_TEXT_CHARS = 2_000_000
# A DOCX is a small zip that expands a lot; more than this unpacked is a zip bomb, not a document.
MAX_UNZIPPED_BYTES = 200 * 1024 * 1024


@dataclass(frozen=True)
class ConversionLimits:
    file_bytes: int = MAX_FILE_BYTES
    text_chars: int = MAX_TEXT_CHARS
    unzipped_bytes: int = MAX_UNZIPPED_BYTES
    # elements in a DOCX's XML parts (counted while streaming, documents/docx_scan.py): mammoth keeps ~230 bytes
    # of Python objects per element (measured: +147 MB for 640,000 empty ones), so 500,000 stay inside
    # `memory_bytes` (a document of ~50,000 short paragraphs)
    xml_tags: int = 500_000
    pdf_pages: int = 5_000  # 400 characters a page reaches `text_chars`
    # address space the worker may add to what it starts with; with the ~35 MiB it shares with the fork server,
    # refusing any file costs under 200 MiB of RSS
    memory_bytes: int = 160 * 2**20
    seconds: float = 10.0  # wall clock; the worker's CPU time is limited to the same

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"ConversionLimits.{field.name} must be positive, got {getattr(self, field.name)!r}")


DEFAULT_LIMITS = ConversionLimits()
