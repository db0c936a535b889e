"""Files built to exhaust the converter are refused by the bound they hit, and cost the app nothing.

Each conversion runs in a worker process bounded in memory and time (documents/isolation.py), so the app's
own memory is asserted here to stay where it was; the worker's bounds are asserted directly (an allocation
past them, a sleep past them, a crash). Sizes are scaled down from issue 34's probes where the bound
scales with them.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib

import psutil
import pytest
from test_documents import docx_bytes, paragraph, pdf_bytes

from documents import (
    ConversionLimits,
    DocumentError,
    attachment_digest,
    attachment_name,
    convert_bytes,
)
from documents.html_text import TextTooLong, html_to_text
from documents.isolation import run_bounded

MiB = 2**20


class PeakMemory:
    """The largest growth of this process's RSS while the block runs, sampled every 10 ms."""

    def __enter__(self):
        self._process, self._done = psutil.Process(), threading.Event()
        self.before = self.peak = self._process.memory_info().rss
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self):
        while not self._done.wait(0.01):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        self._done.set()
        self._sampler.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.before


def refusal(name: str, data: bytes, limits: ConversionLimits | None = None) -> tuple[str, int]:
    """The refusal's message and this process's peak RSS growth while it was made."""
    with PeakMemory() as memory, pytest.raises(DocumentError) as caught:
        convert_bytes(name, data, *(limits,) if limits else ())
    return str(caught.value), memory.growth


def pdf_with_content(content: bytes) -> bytes:
    """A one-page PDF whose page content is `content`, flate-compressed."""
    stream = zlib.compress(content, 9)
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >> >> "
         b"/Contents 4 0 R >>"),
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    return _pdf(objects)


def _pdf(objects: list[bytes]) -> bytes:
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    return bytes(out)


# ---- the worker's own bounds -----------------------------------------------------------------------------

def test_a_conversion_that_allocates_past_its_memory_bound_is_stopped_without_touching_the_app():
    limits = ConversionLimits(memory_bytes=64 * MiB)
    with PeakMemory() as memory, pytest.raises(DocumentError) as caught:
        run_bounded(bytearray, (512 * MiB,), limits, "big.pdf")
    assert str(caught.value).startswith("big.pdf needs more than 64 MiB of memory to convert")
    assert memory.growth < 32 * MiB


def test_a_conversion_that_runs_past_its_time_is_killed():
    with pytest.raises(DocumentError) as caught:
        run_bounded(time.sleep, (60,), ConversionLimits(seconds=1), "slow.html")
    assert str(caught.value).startswith("slow.html took longer than 1 seconds to convert")


def test_a_converter_that_crashes_is_a_refusal_not_a_dead_app():
    with pytest.raises(DocumentError, match="crash.pdf could not be converted: the converter stopped on it"):
        run_bounded(os.abort, (), ConversionLimits(), "crash.pdf")
    assert convert_bytes("after.txt", b"still converting").text == "still converting"


# ---- what a file expands to ------------------------------------------------------------------------------

def test_docx_of_millions_of_empty_paragraphs_is_refused_by_its_element_count():
    data = docx_bytes("<w:p/>" * 3_500_000, pages=None)  # issue 34's 20 MiB of <w:p/>, 30 KB zipped
    assert len(data) < 100_000
    message, growth = refusal("empty.docx", data)
    assert message.startswith("empty.docx is made of more than 500,000 XML elements")
    assert growth < 64 * MiB


def test_docx_under_the_element_bound_still_converts():
    limits = ConversionLimits(xml_tags=100)
    small = docx_bytes(paragraph("fits"), pages=None)
    assert convert_bytes("small.docx", small, limits).text == "fits"
    with pytest.raises(DocumentError, match="more than 100 XML elements"):
        convert_bytes("many.docx", docx_bytes(paragraph("x") * 40, pages=None), limits)  # 3 elements each


def test_pdf_page_whose_stream_inflates_past_the_memory_bound_is_refused():
    # issue 34: a 150 KB PDF of one 50 MiB flate stream grew the app by 6.4 GiB; here 10 MiB inflated from 21 KB,
    # a million text operators whose text page takes PDFium ~1.2 GB (measured in-process)
    data = pdf_with_content(b"BT /F1 1 Tf " + b"(aaaa) Tj " * MiB + b" ET")
    assert len(data) < 32_000
    message, growth = refusal("inflated.pdf", data)
    assert message.startswith("inflated.pdf ") and "160 MiB of memory" in message
    assert growth < 64 * MiB


def test_one_pdf_page_with_more_text_than_the_limit_is_refused_before_its_text_is_built():
    data = pdf_with_content(b"BT /F1 1 Tf (" + b"word " * 2_000 + b") Tj ET")
    message, _ = refusal("long.pdf", data, ConversionLimits(text_chars=5_000))
    assert message.startswith("long.pdf holds more than 5,000 characters of text")


def test_pdf_with_more_pages_than_the_limit_is_refused():
    data = pdf_bytes([[f"page {n}"] for n in range(12)])
    message, _ = refusal("thick.pdf", data, ConversionLimits(pdf_pages=10))
    assert message == "thick.pdf has 12 pages; attachments may have at most 10. Attach the pages you need."


def test_pdf_whose_page_tree_loops_is_a_clear_refusal():
    looping = _pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>",
                    b"<< /Type /Pages /Parent 2 0 R /Kids [2 0 R] /Count 1 >>"])
    message, _ = refusal("loop.pdf", looping)
    assert message.startswith("loop.pdf ")


def test_pdf_whose_page_tree_nests_thousands_deep_is_a_clear_refusal():
    depth = 5_000
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    for level in range(depth):
        number = 2 + level
        objects.append(b"<< /Type /Pages /Kids [%d 0 R] /Count 1 >>" % (number + 1))
    objects.append(b"<< /Type /Page /MediaBox [0 0 10 10] >>")
    message, _ = refusal("deep.pdf", _pdf(objects))
    assert message.startswith("deep.pdf ")


# ---- HTML: linear, and stopped by its output -------------------------------------------------------------

def test_html_of_many_whitespace_only_nodes_converts_within_the_time_bound():
    # quadratic before (a search back over 40,000 empty parts per node: ~20 s here); now well inside 10 s
    html = ("<html><body><p>start</p>" + "<i> </i>\n" * 40_000 + "<p>end</p></body></html>").encode()
    assert convert_bytes("spaces.html", html).text == "start\n\nend"


def test_html_of_deeply_nested_spans_converts():
    depth = 100_000
    html = ("<html><body>" + "<span>" * depth + "deep" + "</span>" * depth + "</body></html>").encode()
    assert convert_bytes("nested.html", html).text == "deep"


def test_html_text_stops_as_soon_as_it_passes_the_limit():
    with pytest.raises(TextTooLong):
        html_to_text("<p>word</p>" * 10_000, max_chars=1_000)
    assert html_to_text("<p>word</p>" * 10, max_chars=1_000).count("word") == 10
    message, _ = refusal("wordy.html", b"<html><body>" + b"<p>word</p>" * 10_000, ConversionLimits(text_chars=1_000))
    assert message.startswith("wordy.html holds more than 1,000 characters of text")


# ---- names and sizes before reading ----------------------------------------------------------------------

def test_names_are_capped_and_lose_bidi_controls_and_markup():
    long = "a" * 5_000 + ".pdf"
    assert len(attachment_name(long)) == 255 and attachment_name(long).endswith("….pdf")
    assert attachment_name("invoice\u202etxt.exe") == "invoicetxt.exe"
    assert attachment_name("<img src=x onerror=alert(1)>.md") == "_img src=x onerror=alert(1)_.md"
    assert attachment_name("a\u2066b\u2069\u200fc.txt") == "abc.txt"


def test_an_attached_file_is_sized_before_it_is_hashed(tmp_path):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.truncate(4 * 2**30)  # sparse: reading it would take 4 GiB
    with PeakMemory() as memory, pytest.raises(DocumentError, match="at most 20 MB"):
        attachment_digest(huge)
    assert memory.growth < 16 * MiB
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 3 * MiB)
    assert attachment_digest(small) == hashlib.sha256(b"x" * 3 * MiB).hexdigest()


def test_limits_are_checked_in_one_place():
    with pytest.raises(ValueError, match="memory_bytes"):
        ConversionLimits(memory_bytes=0)
