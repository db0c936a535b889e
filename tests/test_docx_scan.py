"""A DOCX is streamed through expat to its first bound before mammoth holds any part whole: the memory the scan
takes is asserted with tracemalloc (the file's bytes are made before tracing starts), not its seconds."""

from __future__ import annotations

import io
import tracemalloc
import zipfile

import pytest
from test_documents import W, docx_bytes, paragraph

from documents import ConversionLimits, DocumentError, convert_bytes
from documents.docx_scan import MOST_TOKEN_BYTES, scan_docx

MiB = 2**20


def streamed_docx(before: str, repeated: bytes, times: int, after: str, part: str = "word/document.xml") -> bytes:
    """A DOCX whose `part` is `before`, `repeated` × `times`, `after`, written a block at a time (a part of
    hundreds of MiB is never held here)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats'
                                                '.org/package/2006/content-types"/>')
        with archive.open(part, "w", force_zip64=True) as member:
            member.write(before.encode())
            for _ in range(times):
                member.write(repeated)
            member.write(after.encode())
    return buffer.getvalue()


def refused_with_peak(name: str, data: bytes, limits: ConversionLimits = ConversionLimits()) -> tuple[str, int]:
    """The scan's refusal and the most memory Python (expat's buffers included) held while it ran."""
    tracemalloc.start()
    try:
        with pytest.raises(DocumentError) as caught:
            scan_docx(name, data, limits)
        return str(caught.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_twenty_mib_of_empty_paragraphs_is_refused_in_little_memory():
    data = docx_bytes("<w:p/>" * 3_500_000, pages=None)  # issue 34's bomb: 30 KB zipped
    message, peak = refused_with_peak("empty.docx", data)
    assert message.startswith("empty.docx is made of more than 500,000 XML elements")
    assert peak < 2 * MiB, peak  # a tree of 500,000 elements would take over 100 MiB


def test_text_past_the_limit_in_one_run_stops_the_scan_there_in_little_memory():
    run = streamed_docx(f'<w:document {W}><w:body><w:p><w:r><w:t>', b"a" * MiB, 64, "</w:t></w:r></w:p></w:body>"
                        "</w:document>")
    assert len(run) < 2 * MiB  # 64 MiB of text, one element
    message, peak = refused_with_peak("long.docx", run)
    assert message.startswith("long.docx holds more than 2,000,000 characters of text")
    assert peak < 2 * MiB, peak
    # through the worker: the same sentence, where mammoth would have run out of the worker's memory on it
    with pytest.raises(DocumentError, match="long.docx holds more than 2,000,000 characters of text"):
        convert_bytes("long.docx", run)


def test_text_is_counted_across_runs_and_only_where_mammoth_reads_it():
    limits = ConversionLimits(text_chars=100)
    assert scan_docx("short.docx", docx_bytes(paragraph("abcdefghij") * 9, pages=None), limits).text_chars == 90
    with pytest.raises(DocumentError, match="more than 100 characters of text"):
        scan_docx("long.docx", docx_bytes(paragraph("abcdefghij") * 11, pages=None), limits)
    header = f'<w:hdr {W}>{paragraph("h" * 500)}</w:hdr>'.encode()  # mammoth leaves headers out
    budget = scan_docx("header.docx", docx_bytes(paragraph("body"), pages=None,
                                                 extra_parts={"word/header1.xml": header}), limits)
    assert budget.text_chars == 4 and budget.elements > 5


def test_one_tag_longer_than_any_word_writes_is_refused_before_it_is_held():
    huge_attribute = streamed_docx(f'<w:document {W}><w:body><w:p w:rsidR="', b"0" * MiB,
                                   MOST_TOKEN_BYTES // MiB * 8, '"/></w:body></w:document>')
    message, peak = refused_with_peak("tag.docx", huge_attribute)
    assert "has an XML tag or comment over 4 MiB long" in message
    # expat holds the unfinished token, its buffer doubling as it grows: a few times the bound, not 12 MiB × 8
    assert peak < 4 * MOST_TOKEN_BYTES, peak


def test_unpacked_bytes_are_counted_as_they_stream():
    data = streamed_docx(f'<w:document {W}><w:body>', b"<w:p/>" * 1000, 200, "</w:body></w:document>")
    limits = ConversionLimits(unzipped_bytes=512 * 1024, xml_tags=10**9)
    message, _ = refused_with_peak("big.docx", data, limits)
    assert message.startswith("big.docx unpacks to more than 524,288 bytes")


def test_a_dtd_and_damaged_xml_are_refused_saying_why():
    laughs = ('<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;">]>'
              f'<w:document {W}><w:body>{paragraph("&b;")}</w:body></w:document>')
    data = streamed_docx("", laughs.encode(), 1, "")
    with pytest.raises(DocumentError, match="declares a DTD"):
        scan_docx("laughs.docx", data, ConversionLimits())
    cut = docx_bytes(paragraph("fine"), pages=None, extra_parts={"word/styles.xml": b"<w:styles><w:style>"})
    with pytest.raises(DocumentError, match="could not be read as a Word document"):
        scan_docx("cut.docx", cut, ConversionLimits())


def decoy_docx(main_part: str, body_xml: str) -> bytes:
    """A small `word/document.xml` as a decoy, while `_rels/.rels` sends mammoth to `main_part`."""
    rels = ('<?xml version="1.0"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/'
            'relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/'
            f'relationships/officeDocument" Target="/{main_part}"/></Relationships>')
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats'
                                                '.org/package/2006/content-types"/>')
        archive.writestr("_rels/.rels", rels)
        archive.writestr("word/document.xml", f'<w:document {W}><w:body>{paragraph("decoy")}</w:body></w:document>')
        archive.writestr(main_part, f'<w:document {W}><w:body>{body_xml}</w:body></w:document>')
    return buffer.getvalue()


@pytest.mark.parametrize("main_part", ["word/main", "word/main.xml"], ids=["no-extension", "other-name"])
def test_the_main_document_is_found_as_mammoth_finds_it_not_by_its_name(main_part):
    limits = ConversionLimits(xml_tags=1_000, text_chars=1_000)
    with pytest.raises(DocumentError, match="more than 1,000 XML elements"):
        scan_docx("decoy.docx", decoy_docx(main_part, "<w:p/>" * 5_000), limits)
    with pytest.raises(DocumentError, match="more than 1,000 characters of text"):
        scan_docx("decoy.docx", decoy_docx(main_part, paragraph("x" * 2_000)), limits)


def test_attributes_and_text_outside_t_elements_are_counted():
    limits = ConversionLimits(xml_tags=1_000, text_chars=1_000)
    attributes = " ".join(f'w:a{n}="1"' for n in range(2_000))  # one element, one object per attribute in a tree
    with pytest.raises(DocumentError, match="more than 1,000 XML elements"):
        scan_docx("attributes.docx", docx_bytes(f"<w:p {attributes}/>", pages=None), limits)
    field_code = f"<w:p><w:r><w:instrText>{'y' * 2_000}</w:instrText></w:r></w:p>"
    with pytest.raises(DocumentError, match="more than 1,000 characters of text"):
        scan_docx("field.docx", docx_bytes(field_code, pages=None), limits)
    # whitespace between elements (pretty-printed XML) is not text
    assert scan_docx("pretty.docx", docx_bytes("\n  " * 600 + paragraph("ok"), pages=None), limits).text_chars == 2
