"""Attached documents: every format converts to the text written into it, every bad file gets a clear error.

Fixtures are built here, byte by byte: a PDF writer of a few lines (text pages or an image-only page),
pypdf (a test-only dependency) to encrypt one, and a DOCX as the zip of XML parts that it is.
"""

from __future__ import annotations

import hashlib
import io
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from documents import (
    MAX_FILE_BYTES,
    MAX_TEXT_CHARS,
    ConversionLimits,
    Document,
    DocumentError,
    attachment_text,
    convert_bytes,
    convert_file,
    message_with_attachments,
)

PNG_BYTES = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00"
             b"\x90wS\xde\x00\x00\x00\x0cIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N\x00\x00\x00\x00"
             b"IEND\xaeB`\x82")


# ---- fixture builders ------------------------------------------------------------------------------

def pdf_bytes(pages: list[list[str]] | None = None, image_only: bool = False) -> bytes:
    """A minimal valid PDF: one page per entry of `pages` (its lines in Helvetica), or one page with
    only a 2x2 image when `image_only`."""
    contents: list[bytes] = []
    if image_only:
        contents.append(b"q 200 0 0 200 100 400 cm /Im1 Do Q")
    for lines in pages or []:
        shown = b" T* ".join(b"(" + line.encode("latin-1").replace(b"\\", b"\\\\").replace(b"(", b"\\(")
                             .replace(b")", b"\\)") + b") Tj" for line in lines)
        contents.append(b"BT /F1 12 Tf 14 TL 72 720 Td " + shown + b" ET")
    objects = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        4: b"<< /Type /XObject /Subtype /Image /Width 2 /Height 2 /ColorSpace /DeviceRGB "
           b"/BitsPerComponent 8 /Length 12 >>\nstream\n" + bytes(range(12)) + b"\nendstream",
    }
    kids = []
    for index, content in enumerate(contents):
        page_number, content_number = 5 + 2 * index, 6 + 2 * index
        kids.append(b"%d 0 R" % page_number)
        objects[page_number] = (
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> "
            b"/XObject << /Im1 4 0 R >> >> /Contents %d 0 R >>" % content_number)
        objects[content_number] = b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream"
    objects[2] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    out = bytearray(b"%PDF-1.4\n")
    offsets = {}
    for number in sorted(objects):
        offsets[number] = len(out)
        out += b"%d 0 obj\n" % number + objects[number] + b"\nendobj\n"
    xref_at = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offsets[number] for number in sorted(objects))
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_at)
    return bytes(out)


def encrypted_pdf_bytes(user_password: str, owner_password: str = "owner") -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes([["Secret plans"]]))))
    writer.encrypt(user_password=user_password, owner_password=owner_password)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def docx_bytes(body_xml: str, pages: int | None = 3, extra_parts: dict[str, bytes] | None = None) -> bytes:
    """A DOCX as Word writes it, cut to the parts a reader needs."""
    parts = {
        "[Content_Types].xml": (
            '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/'
            '2006/content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats-'
            'package.relationships+xml"/><Default Extension="xml" ContentType="application/xml"/>'
            '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-'
            'officedocument.wordprocessingml.document.main+xml"/></Types>'),
        "_rels/.rels": (
            '<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/'
            'package/2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/'
            'officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/></Relationships>'),
        "word/document.xml": f'<?xml version="1.0" encoding="UTF-8"?><w:document {W}><w:body>{body_xml}'
                             f'</w:body></w:document>',
    }
    if pages is not None:
        parts["docProps/app.xml"] = (
            '<?xml version="1.0" encoding="UTF-8"?><Properties xmlns="http://schemas.openxmlformats.org/'
            f'officeDocument/2006/extended-properties"><Pages>{pages}</Pages></Properties>')
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in parts.items():
            archive.writestr(name, content)
        for name, content in (extra_parts or {}).items():
            archive.writestr(name, content)
    return buffer.getvalue()


def paragraph(text: str, style: str | None = None) -> str:
    properties = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
    return f"<w:p>{properties}<w:r><w:t>{text}</w:t></w:r></w:p>"


class WordTokenizer:
    """Stands in for a Hugging Face tokenizer: one token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return list(range(len(text.split())))


def error_of(name: str, data: bytes) -> str:
    with pytest.raises(DocumentError) as caught:
        convert_bytes(name, data)
    return str(caught.value)


# ---- formats -----------------------------------------------------------------------------------------

def test_pdf_with_a_text_layer_gives_its_text_page_count_and_hash(tmp_path: Path):
    data = pdf_bytes([["Quarterly report", "Costs rose by 12 percent."], ["Page two (appendix)"]])
    path = tmp_path / "report.pdf"
    path.write_bytes(data)
    document = convert_file(path)
    assert document.kind == "pdf" and document.pages == 2 and document.name == "report.pdf"
    assert "Quarterly report" in document.text and "Costs rose by 12 percent." in document.text
    assert "Page two (appendix)" in document.text
    assert document.text.index("Costs rose") < document.text.index("Page two")
    assert document.sha256 == hashlib.sha256(data).hexdigest() and document.size_bytes == len(data)
    assert "\r" not in document.text
    tokens = len(attachment_text(document).split())
    assert document.card(WordTokenizer()) == f"report.pdf · 2 pages · {tokens:,} tokens"


def test_a_one_page_pdf_card_says_page_not_pages():
    document = convert_bytes("memo.pdf", pdf_bytes([["Short memo"]]))
    assert document.card().startswith("memo.pdf · 1 page · ") and document.card().endswith(" characters")


def test_pdf_with_only_an_image_asks_for_ocr():
    message = error_of("scan.pdf", pdf_bytes(image_only=True))
    assert "this PDF has no text layer (scanned pages?); OCR it first" in message
    assert message.startswith("scan.pdf")


def test_password_protected_pdf_is_refused_with_what_to_do():
    message = error_of("locked.pdf", encrypted_pdf_bytes(user_password="secret"))
    assert "locked.pdf is password-protected" in message and "Remove the password" in message


def test_pdf_with_only_an_owner_password_opens_like_any_pdf():
    # Restrictions without an open password (common in exported PDFs) do not stop a reader.
    document = convert_bytes("restricted.pdf", encrypted_pdf_bytes(user_password=""))
    assert "Secret plans" in document.text and document.pages == 1


def test_damaged_pdf_is_refused():
    message = error_of("broken.pdf", b"%PDF-1.4\n" + bytes(range(256)) * 4)
    assert "could not be read as a PDF" in message


def test_docx_gives_headings_paragraphs_tables_and_the_recorded_page_count(tmp_path: Path):
    body = (paragraph("Project plan", style="Heading1") + paragraph("We ship in March &amp; April.")
            + '<w:tbl><w:tr><w:tc><w:p><w:r><w:t>Task</w:t></w:r></w:p></w:tc>'
              '<w:tc><w:p><w:r><w:t>Owner</w:t></w:r></w:p></w:tc></w:tr></w:tbl>'
            + paragraph("Ünïcode survives."))
    data = docx_bytes(body, pages=3)
    path = tmp_path / "plan.docx"
    path.write_bytes(data)
    document = convert_file(path)
    assert document.kind == "docx" and document.pages == 3
    assert "# Project plan" in document.text
    assert "We ship in March & April." in document.text
    assert "Task | Owner" in document.text and "Ünïcode survives." in document.text
    assert document.sha256 == hashlib.sha256(data).hexdigest()


def test_docx_without_a_recorded_page_count_counts_lines():
    document = convert_bytes("notes.docx", docx_bytes(paragraph("one") + paragraph("two"), pages=None))
    assert document.pages is None and document.text == "one\n\ntwo" and document.extent() == "3 lines"


def test_html_keeps_visible_text_and_drops_scripts_and_styles():
    html = (b"<!DOCTYPE html><html><head><title>Release notes</title><style>body{color:red}</style>"
            b"<script>var secret = '<p>not text</p>';</script></head><body><h2>Version 2</h2>"
            b"<p>Faster   startup\n and <b>fewer</b> bugs.</p><ul><li>alpha</li><li>beta</li></ul>"
            b"<noscript>enable JS</noscript><pre>  keep\n    indent</pre></body></html>")
    document = convert_bytes("notes.html", html)
    assert document.kind == "html"
    assert document.text == ("Release notes\n\n## Version 2\n\nFaster startup and fewer bugs.\n\n- alpha\n- beta"
                             "\n\n  keep\n    indent")
    assert "secret" not in document.text and "color" not in document.text and "JS" not in document.text


def test_html_without_an_extension_is_recognised_by_its_content():
    document = convert_bytes("download", b"<html><body><p>Hi there</p></body></html>")
    assert document.kind == "html" and document.text == "Hi there"


def test_markdown_is_kept_as_written():
    markdown = "# Notes\n\n- first point\n- second point\n\n```python\nprint('x')\n```"
    document = convert_bytes("notes.md", markdown.encode())
    assert document.kind == "text" and document.text == markdown and document.lines == 8
    assert document.card(WordTokenizer()).startswith("notes.md · 8 lines · ")


def test_source_code_keeps_its_indentation_and_name(tmp_path: Path):
    code = 'def greet(name: str) -> str:\n    """Say hello."""\n\treturn f"Hello, {name}!"\n'
    path = tmp_path / "upload-123"
    path.write_text(code)
    document = convert_file(path, name="greet.py")
    assert document.name == "greet.py" and document.kind == "text"
    assert document.text == code.rstrip("\n")
    assert attachment_text(document).startswith('<document name="greet.py" kind="text" lines="3">\n')


def test_line_endings_and_byte_order_mark_do_not_change_the_text():
    unix = convert_bytes("a.txt", "first\nsecond\n".encode())
    windows = convert_bytes("a.txt", "\ufefffirst\r\nsecond\r\n".encode())
    utf16 = convert_bytes("a.txt", "first\r\nsecond\r\n".encode("utf-16"))
    assert unix.text == windows.text == utf16.text == "first\nsecond"
    assert attachment_text(unix) == attachment_text(windows)
    assert unix.sha256 != windows.sha256  # the hash is of the bytes, as the file was given


def test_a_file_without_an_extension_is_taken_for_what_its_content_is():
    assert convert_bytes("report", pdf_bytes([["Inside"]])).kind == "pdf"
    assert convert_bytes("README", b"plain words").kind == "text"


# ---- bad input -----------------------------------------------------------------------------------------

def test_empty_file_is_refused(tmp_path: Path):
    assert error_of("empty.txt", b"") == "empty.txt is empty. Attach a file with text in it."
    (tmp_path / "empty.pdf").write_bytes(b"")
    with pytest.raises(DocumentError, match="empty.pdf is empty"):
        convert_file(tmp_path / "empty.pdf")


def test_whitespace_only_file_is_refused():
    assert "blank.md contains no text" in error_of("blank.md", b" \n\t\r\n ")


def test_pdf_name_on_a_png_is_refused():
    message = error_of("report.pdf", PNG_BYTES)
    assert message.startswith("report.pdf is not a PDF: its content is a PNG image.")


def test_docx_name_on_something_else_is_refused():
    assert error_of("plan.docx", b"just some text").startswith(
        "plan.docx is not a Word (.docx) document: its content is text.")
    other_zip = io.BytesIO()
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("data.csv", "a,b\n1,2\n")
    assert error_of("plan.docx", other_zip.getvalue()).startswith(
        "plan.docx is not a Word (.docx) document: its content is a zip archive.")
    assert error_of("archive.zip", other_zip.getvalue()).startswith(
        "archive.zip cannot be attached: its content is a zip archive.")


def test_other_office_files_are_named_for_what_they_are():
    workbook = io.BytesIO()
    with zipfile.ZipFile(workbook, "w") as archive:
        archive.writestr("xl/workbook.xml", "<workbook/>")
    assert error_of("sales.xlsx", workbook.getvalue()).startswith(
        "sales.xlsx cannot be attached: its content is an Excel workbook.")
    # Word saves a password-protected .docx as an OLE container, the format of the old .doc.
    ole = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504)
    assert error_of("secret.docx", ole).startswith("secret.docx is not a Word (.docx) document: its content is "
                                                   "an old-style Office file (.doc, .xls, .ppt) or a "
                                                   "password-protected Office document.")


def test_text_name_on_a_pdf_is_refused():
    assert error_of("notes.txt", pdf_bytes([["x"]])).startswith("notes.txt is not text: its content is a PDF.")


def test_damaged_docx_is_refused():
    broken = docx_bytes("<w:p><w:r><w:t>unclosed")
    assert "broken.docx could not be read as a Word document" in error_of("broken.docx", broken)


def test_docx_that_unpacks_to_too_much_is_refused():
    data = docx_bytes(paragraph("x" * 20_000))
    with pytest.raises(DocumentError, match="bomb.docx unpacks to"):
        convert_bytes("bomb.docx", data, ConversionLimits(unzipped_bytes=10_000))


def test_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path: Path):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.truncate(5 * 2**30)  # sparse: 5 GB that take no disk and would take 5 GB of memory to read
    with pytest.raises(DocumentError) as caught:
        convert_file(huge)
    assert str(caught.value) == ("huge.txt is 5,120.0 MB; attachments may be at most 20 MB. "
                                 "Attach the part you need, or split the file.")
    assert MAX_FILE_BYTES == 20 * 2**20
    assert "at most 20 MB" in error_of("big.md", b"a" * (MAX_FILE_BYTES + 1))


def test_text_over_the_character_limit_is_refused():
    assert MAX_TEXT_CHARS == 2_000_000
    message = error_of("log.txt", b"abc\n" * (MAX_TEXT_CHARS // 4 + 1))
    assert message.startswith("log.txt holds more than 2,000,000 characters of text")
    assert convert_bytes("log.txt", b"abc\n" * (MAX_TEXT_CHARS // 4 - 1)).lines == MAX_TEXT_CHARS // 4 - 1


@pytest.mark.parametrize(("data", "what"), [
    (PNG_BYTES, "a PNG image"),
    (b"\x7fELF\x02\x01\x01\x00" + bytes(64), "a program (ELF executable)"),
    (random.Random(20).randbytes(4096), "binary data"),
    (b"MZ\x90\x00\x03" + bytes(60), "a Windows program"),
])
def test_binary_data_named_txt_is_refused(data: bytes, what: str):
    assert error_of("notes.txt", data).startswith(f"notes.txt cannot be attached: its content is {what}, not text.")


def test_text_in_a_legacy_encoding_asks_for_utf8():
    message = error_of("brief.txt", "Grüße aus Köln, à bientôt".encode("latin-1"))
    assert "brief.txt is not UTF-8 text" in message and "Save it as UTF-8" in message


# ---- names, the dataclass and the prompt ------------------------------------------------------------

def test_names_lose_folders_line_breaks_and_quotes():
    assert convert_bytes("/tmp/gradio/abc/re\nport\".md", b"x").name == "re_port_.md"
    assert convert_bytes("C:\\Users\\me\\notes.md", b"x").name == "notes.md"


def test_document_checks_its_fields_in_one_place():
    good = dict(name="a.txt", kind="text", text="x", sha256="0" * 64, size_bytes=1)
    Document(**good)
    for field, bad in [("name", "a\nb"), ("kind", "png"), ("text", "  "), ("sha256", "abc"), ("size_bytes", 0)]:
        with pytest.raises(ValueError):
            Document(**{**good, field: bad})
    with pytest.raises(ValueError):
        Document(**good, pages=0)
    assert "xxxxxxxxxx" not in repr(Document(**{**good, "text": "x" * 10}))  # a long text stays out of logs


def test_documents_come_before_the_question_in_a_stable_format():
    report = convert_bytes("report.pdf", pdf_bytes([["Costs rose."]]))
    notes = convert_bytes("notes.md", b"# Notes\nship it")
    message = message_with_attachments("What rose?", [report, notes])
    assert message == (f'<document name="report.pdf" kind="pdf" pages="1">\n{report.text}\n</document>\n\n'
                       '<document name="notes.md" kind="text" lines="2">\n# Notes\nship it\n</document>\n\n'
                       "What rose?")
    assert message_with_attachments("Plain question", []) == "Plain question"
    assert message_with_attachments("", [notes]) == attachment_text(notes)


def test_the_same_file_attached_again_gives_the_same_prompt_prefix():
    data = pdf_bytes([["Chapter one", "It was a dark night."], ["Chapter two"]])
    first = message_with_attachments("Who is the hero?", [convert_bytes("book.pdf", data)])
    second = message_with_attachments("How does it end?", [convert_bytes("book.pdf", data)])
    shared = attachment_text(convert_bytes("book.pdf", data)) + "\n\n"
    assert first.startswith(shared) and second.startswith(shared)


def test_importing_documents_loads_no_converter_and_nothing_of_the_app():
    script = ("import sys, documents; loaded = [m for m in ('pypdfium2', 'mammoth', 'torch', 'gradio', 'ui', "
              "'sessions', 'infinigen_core') if m in sys.modules]; print(loaded)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == "[]"
