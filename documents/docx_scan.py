"""Stream a DOCX's XML parts through expat before mammoth parses any of them whole, and stop at the first bound
it passes: XML elements, unpacked bytes, characters of text, the length of any one tag or comment.

    scan_docx("report.docx", data, limits)   # a DocumentError saying which bound, or None: mammoth may run

mammoth reads each part whole and builds a tree of it (~230 bytes of Python objects per element), and its
text is only counted once it has all been converted. This scan holds one block of a part at a time and no
tree: a 30 KB file of 20 MiB of `<w:p/>`, or one of 190 MiB of text in a single run, is refused after
reading as far as the bound, in a few MiB. Text is counted where mammoth takes it from: the main document,
footnotes, endnotes and comments, found as mammoth finds them (the relationships, `_rels/.rels` and the
parts' own, whatever the parts are named), their `t` elements and any other text that is not whitespace;
elements (and their attributes) and bytes in every XML part and every part a relationship names. A part with
a DTD is refused: Word writes none, and entities are how a small XML file expands.
"""

from __future__ import annotations

import io
import posixpath
import zipfile
from dataclasses import dataclass
from xml.parsers import expat

from documents.document import DocumentError
from documents.limits import ConversionLimits

XML_PARTS = (".xml", ".rels")
TEXT_PARTS = frozenset({"word/document.xml", "word/footnotes.xml", "word/endnotes.xml", "word/comments.xml"})
# relationship types (the end of their URI) whose target mammoth reads text from
TEXT_RELATIONSHIPS = ("/officeDocument", "/footnotes", "/endnotes", "/comments")
BLOCK_BYTES = 64 * 1024
# One tag, comment or run of markup between two events: Word's longest are a few KB (an embedded font's
# name list, a long hyperlink); expat holds a token whole until it ends, so a longer one is refused
MOST_TOKEN_BYTES = 4 * 2**20


class _Refused(Exception):
    """Raised in an expat handler to stop the parse; carries the user's sentence."""


@dataclass
class DocxBudget:
    """What the scan has read so far against `limits`."""

    name: str
    limits: ConversionLimits
    elements: int = 0
    text_chars: int = 0
    unpacked_bytes: int = 0

    def add_element(self, count: int = 1) -> None:
        self.elements += count
        if self.elements > self.limits.xml_tags:
            raise _Refused(f"{self.name} is made of more than {self.limits.xml_tags:,} XML elements, more than an "
                           f"attached Word document may be. Attach a smaller document, or save it as PDF.")

    def add_text(self, chars: int) -> None:
        self.text_chars += chars
        if self.text_chars > self.limits.text_chars:
            raise _Refused(f"{self.name} holds more than {self.limits.text_chars:,} characters of text, more than "
                           f"an attachment may. Attach the part you need, or split the file.")

    def add_bytes(self, size: int) -> None:
        self.unpacked_bytes += size
        if self.unpacked_bytes > self.limits.unzipped_bytes:
            raise _Refused(f"{self.name} unpacks to more than {self.limits.unzipped_bytes:,} bytes, more than an "
                           f"attached Word document may. Attach a smaller document, or save it as PDF.")


def scan_docx(name: str, data: bytes, limits: ConversionLimits) -> DocxBudget:
    """What the DOCX's XML parts hold, counted while streaming; a DocumentError at the first bound passed or
    for XML that is damaged or declares a DTD."""
    budget = DocxBudget(name, limits)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = {info.filename: info for info in archive.infolist()}
            relationships = [info for path, info in members.items() if path.lower().endswith(".rels")]
            named: dict[str, bool] = {}  # every part a relationship names -> whether mammoth reads text from it
            for info in relationships:
                with archive.open(info) as member:
                    for target, kind in _scan_part(member, budget, counts_text=False):
                        part = _resolve(info.filename, target)
                        named[part] = named.get(part, False) or kind.endswith(TEXT_RELATIONSHIPS)
            for path, info in members.items():
                if path.lower().endswith(".rels") or not (path.lower().endswith(".xml") or path in named):
                    continue
                with archive.open(info) as member:
                    _scan_part(member, budget, counts_text=path in TEXT_PARTS or named.get(path, False))
    except _Refused as refusal:
        raise DocumentError(str(refusal)) from None
    except (expat.ExpatError, zipfile.BadZipFile, EOFError, OSError, ValueError):
        raise DocumentError(f"{name} could not be read as a Word document (it may be damaged). "
                            f"Open and save it again, or attach it as PDF.") from None
    return budget


def _resolve(relationships_part: str, target: str) -> str:
    """The archive path a relationship's target names: `word/_rels/document.xml.rels` speaks for `word/`."""
    if target.startswith("/"):
        return posixpath.normpath(target.lstrip("/"))
    folder = posixpath.dirname(posixpath.dirname(relationships_part))
    return posixpath.normpath(posixpath.join(folder, target))


def _scan_part(member, budget: DocxBudget, counts_text: bool) -> list[tuple[str, str]]:
    """Stream one part through expat within the budget; the (target, type) of every internal relationship it
    declares (a `.rels` part's)."""
    parser = expat.ParserCreate()
    declared: list[tuple[str, str]] = []
    since_event = 0  # bytes fed since expat last reported something: one token's length, at most
    text_depth = 0  # how many `t` elements the parse is inside (0 or 1 in a sound file)

    def seen() -> None:
        nonlocal since_event
        since_event = 0

    def start(tag: str, attributes: dict) -> None:
        nonlocal text_depth
        seen()
        budget.add_element(1 + len(attributes))  # mammoth's tree keeps an object per attribute too
        if counts_text and tag.rpartition(":")[2] == "t":
            text_depth += 1
        if tag.rpartition(":")[2] == "Relationship" and attributes.get("TargetMode") != "External" \
                and "Target" in attributes:
            declared.append((attributes["Target"], attributes.get("Type", "")))

    def end(tag: str) -> None:
        nonlocal text_depth
        seen()
        if text_depth and tag.rpartition(":")[2] == "t":
            text_depth -= 1

    def characters(text: str) -> None:
        seen()
        if text_depth or (counts_text and not text.isspace()):
            budget.add_text(len(text))

    def doctype(*_: object) -> None:
        raise _Refused(f"{budget.name} declares a DTD in its XML, which Word documents never do (it is how a small "
                       f"file expands to a huge one). Open and save it again in Word, or attach it as PDF.")

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler, parser.StartDoctypeDeclHandler = characters, doctype
    parser.CommentHandler = lambda _comment: seen()
    parser.ProcessingInstructionHandler = lambda _target, _data: seen()
    while block := member.read(BLOCK_BYTES):
        budget.add_bytes(len(block))
        since_event += len(block)
        parser.Parse(block, False)
        if since_event > MOST_TOKEN_BYTES:
            raise _Refused(f"{budget.name} has an XML tag or comment over {MOST_TOKEN_BYTES // 2**20} MiB long, "
                           f"which Word never writes. Open and save it again in Word, or attach it as PDF.")
    parser.Parse(b"", True)
    return declared
