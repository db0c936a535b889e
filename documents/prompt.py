"""Where attached documents go in a user message, byte for byte.

The format is fixed so that the same file attached again gives the same prompt text, and with it
the same tokens: a later chat about the same file then shares the document's KV cache with earlier
ones as a common token prefix. For that reason the documents come BEFORE the question (a new
question only changes the tokens after them). A message without attachments is left unchanged.
Checked with SmolLM2's tokenizer and chat template: two questions after the same documents share
every token up to and including the last `</document>`.

    <document name="report.pdf" kind="pdf" pages="12">
    ...the document's text...
    </document>

    <document name="notes.md" kind="text" lines="40">
    ...
    </document>

    What does the report say about costs?
"""

from __future__ import annotations

from collections.abc import Sequence

from documents.document import Document

ATTACHMENT_SEPARATOR = "\n\n"


def attachment_text(document: Document) -> str:
    """The document as the model reads it: an opening tag naming the file, the text, a closing tag."""
    extent = f'pages="{document.pages}"' if document.pages is not None else f'lines="{document.lines}"'
    return f'<document name="{document.name}" kind="{document.kind}" {extent}>\n{document.text}\n</document>'


def message_with_attachments(question: str, documents: Sequence[Document]) -> str:
    """The user message: each document in the order given, then the question (if any)."""
    if not documents:
        return question
    parts = [attachment_text(document) for document in documents]
    if question:
        parts.append(question)
    return ATTACHMENT_SEPARATOR.join(parts)


def attachment_record(document: Document, tokens: int | None = None) -> dict:
    """What a stored message keeps of an attachment: facts for its card, never the file's bytes (its text is in
    the message's content). `chars` is the length of its `attachment_text`, so the question can be cut from the
    content exactly (`question_of`); `tokens` counts that text with the model's tokenizer where known. A
    document read by passages also keeps `read`, what of it was read ('report.pdf: pages 1, 36-38')."""
    record = {"name": document.name, "kind": document.kind, "pages": document.pages, "lines": document.lines,
              "tokens": tokens, "sha256": document.sha256, "size_bytes": document.size_bytes,
              "chars": len(attachment_text(document))}
    if document.read is not None:
        record["read"] = document.read
    return record


def attachment_card(record: dict) -> str:
    """One line for a stored attachment: '📄 report.pdf · 12 pages · 6,031 tokens', or for one read by passages
    '📄 report.pdf · 120 pages · read: pages 1, 36-38 · 93 tokens' (its lines are the passages', not shown)."""
    def plural(count: int, noun: str) -> str:
        return f"{count:,} {noun}" + ("" if count == 1 else "s")

    parts = [f"📄 {record.get('name', 'attachment')}"]
    read = record.get("read")
    if record.get("pages"):
        parts.append(plural(int(record["pages"]), "page"))
    elif record.get("lines") and not read:
        parts.append(plural(int(record["lines"]), "line"))
    if isinstance(read, str):
        parts.append("read: " + read.split(": ", 1)[-1])
    if record.get("tokens") is not None:
        parts.append(plural(int(record["tokens"]), "token"))
    return " · ".join(parts)


def question_of(content: str, records: Sequence[dict]) -> str:
    """The question of a message made by `message_with_attachments` from documents with these records."""
    if not records:
        return content
    try:
        skip = sum(int(r["chars"]) for r in records) + len(ATTACHMENT_SEPARATOR) * len(records)
    except (KeyError, TypeError, ValueError):  # a record from elsewhere: show the whole text rather than guess
        return content
    return content[skip:]


def displayed_message(content: str, records: Sequence[dict]) -> str:
    """A stored message as the chat shows it: one card line per attachment, then the question (not the text)."""
    if not records:
        return content
    cards = "\n".join(attachment_card(r) for r in records)
    question = question_of(content, records)
    return f"{cards}\n\n{question}" if question else cards


def documents_of(content: str, records: Sequence[dict]) -> list[Document]:
    """The documents a stored message was made from (its content holds their text, its records the rest), so
    they can be attached again byte for byte: the same prompt text, the same tokens, a shared KV prefix."""
    found, offset = [], 0
    for record in records:
        piece = content[offset:offset + int(record["chars"])]
        offset += int(record["chars"]) + len(ATTACHMENT_SEPARATOR)
        body = piece.split("\n", 1)[1].rsplit("\n</document>", 1)[0]
        found.append(Document(name=record["name"], kind=record["kind"], text=body, sha256=record["sha256"],
                              size_bytes=int(record["size_bytes"]), pages=record.get("pages"),
                              read=record.get("read")))
    return found
