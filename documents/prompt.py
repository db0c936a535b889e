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
