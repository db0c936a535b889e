"""Which of a message's attached documents are read whole and which by passages: whole while the message fits
the window, else the longest ones by passages, one at a time, until it fits.

    documents = fit_message(question, documents, fits=lambda content: check(content).fits,
                            read=lambda document: read_by_passages(document, question))
    message_with_attachments(question, documents)        # the message as stored and read

The faces pass their own window rule as `fits` (the page: the open session's check; the API: the
conversation up to that message), so a document is read by passages exactly when reading it whole would not
fit. What comes out depends only on the message and what precedes it, so the same request sent again gives
the same text (and shares the stored KV of the first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from documents.document import Document
from documents.prompt import message_with_attachments


def fit_message(question: str, documents: Sequence[Document], fits: Callable[[str], bool],
                read: Callable[[Document], Document]) -> tuple[Document, ...]:
    """`documents` as the message reads them. When even all of them read by passages do not fit, the caller's
    window rule refuses the message as before (the question or the earlier turns are too long)."""
    chosen = list(documents)
    longest_first = sorted(range(len(chosen)), key=lambda i: len(chosen[i].text), reverse=True)
    for number in longest_first:
        if fits(message_with_attachments(question, chosen)):
            break
        if chosen[number].read is None:  # a document attached again from a stored message is read already
            chosen[number] = read(chosen[number])
    return tuple(chosen)


def reading_summary(documents: Sequence[Document]) -> list[str]:
    """Per document what the model reads of it: 'report.pdf: pages 1, 36-38', or 'notes.txt: whole'."""
    return [document.read or f"{document.name}: whole" for document in documents]
