"""Which of a message's attached documents are read whole and which by passages: whole while the message fits
the window, else the longest ones by passages, one at a time, until it fits.

    documents = fit_message(question, documents, fits=lambda content: check(content).fits,
                            read=lambda document: read_by_passages(document, question),
                            earlier=[message.content for message in history])   # no text read twice
    message_with_attachments(question, documents)        # the message as stored and read

The faces pass their own window rule as `fits` (the page: the open session's check; the API: the
conversation up to that message), so a document is read by passages exactly when reading it whole would not
fit. What comes out depends only on the message and what precedes it, so the same request sent again gives
the same text (and shares the stored KV of the first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from documents.document import Document
from documents.prompt import attachment_text, documents_of, message_with_attachments, question_of

READ_ABOVE = " (already read above)"  # ends the `read` of a document whose text the conversation holds already
# what such a document's text becomes in the new message: a few tokens instead of the same text read again
READ_ABOVE_TEXT = "[The same text as attached above.]"


def fit_message(question: str, documents: Sequence[Document], fits: Callable[[str], bool],
                read: Callable[[Document], Document], earlier: Sequence[str] = ()) -> tuple[Document, ...]:
    """`documents` as the message reads them. When even all of them read by passages do not fit, the caller's
    window rule refuses the message as before (the question or the earlier turns are too long). A document
    whose text (whole, or the passages chosen for this question) is already in one of the `earlier` messages
    of the conversation is not read again (`read_above`)."""
    chosen = [read_above(document, earlier) for document in documents]
    longest_first = sorted(range(len(chosen)), key=lambda i: len(chosen[i].text), reverse=True)
    for number in longest_first:
        if fits(message_with_attachments(question, chosen)):
            break
        if chosen[number].read is None:  # a document attached again from a stored message is read already
            chosen[number] = read_above(read(chosen[number]), earlier)
    return tuple(chosen)


def is_read_above(attached: Mapping | Document) -> bool:
    """Whether an attachment (a stored record, or a Document) is a reference to a file's text held by an earlier
    message ("[The same text as attached above.]"), not the text itself."""
    read = attached.get("read") if isinstance(attached, Mapping) else attached.read
    return isinstance(read, str) and read.endswith(READ_ABOVE)


def read_above(document: Document, earlier: Sequence[str]) -> Document:
    """`document` as a short reference when its text as the model reads it is already in one of the `earlier`
    messages (the same file attached again, whole or with the same passages chosen): the model attends to
    it there, so it costs no new reading. Otherwise `document` itself."""
    if is_read_above(document):
        return document
    text = attachment_text(document)
    if not any(text in message for message in earlier):
        return document
    what = document.read or f"{document.name}: whole"
    return dataclasses.replace(document, text=READ_ABOVE_TEXT, page_starts=None, read=what + READ_ABOVE)


def with_sources(content: str, records: Sequence[dict], earlier: Sequence[str],
                 sources: Sequence[tuple[str, Sequence[dict]]]) -> tuple[str, tuple[dict, ...]]:
    """A stored message (`content`, `records`) with each reference ("[The same text as attached above.]") whose
    text none of the `earlier` messages holds any more (the turn that held it was dropped) made that text again,
    byte for byte as the first of the `sources` messages (content, records) that holds it had it, with its
    record. A reference whose text is still above, or with no such source, stays as it is."""
    if not any(is_read_above(record) for record in records):
        return content, tuple(records)
    documents, kept = documents_of(content, records), list(records)
    for number, record in enumerate(records):
        found = _source(record, sources) if is_read_above(record) else None
        if found is not None and not any(attachment_text(found[0]) in message for message in earlier):
            documents[number], kept[number] = found
    if kept == list(records):
        return content, tuple(records)
    return message_with_attachments(question_of(content, records), documents), tuple(kept)


def _source(reference: dict, sources: Sequence[tuple[str, Sequence[dict]]]) -> tuple[Document, dict] | None:
    """The first document of `sources` (and its record) that `read_above` makes `reference` of."""
    for content, records in sources:
        for document, record in zip(documents_of(content, records), records):
            if record.get("sha256") == reference.get("sha256") and not is_read_above(record) and \
                    read_above(document, [attachment_text(document)]).read == reference.get("read"):
                return document, record
    return None


def reading_summary(documents: Sequence[Document]) -> list[str]:
    """Per document what the model reads of it: 'report.pdf: pages 1, 36-38', or 'notes.txt: whole'."""
    return [document.read or f"{document.name}: whole" for document in documents]
