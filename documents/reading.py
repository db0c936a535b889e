"""Reading a document longer than the window: the passages that matter to the question, up to a budget.

    index = PassageIndex.open(data_dir / "passages", document, READING.passage_tokens, data=file_bytes)
    reading = read_for_question(index, document, "What does it say about costs?", READING, count_tokens)
    message_with_attachments(question, [reading.document])   # the chosen passages in place of the whole text
    reading.description                                      # 'report.pdf: pages 1, 36-38' (card, header, record)

The document's first passage (its title and outline) and the passages with the best BM25 score for the
question are read, in document order, each headed by where it stood ("[page 36]", "[lines 840-861]"), as
many as `budget_tokens` holds counted with the model's tokenizer. A document that fits the window whole is
read whole: only call this when it does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from documents.document import Document
from documents.passage_index import PassageIndex
from documents.passages import Passage, describe_read

PASSAGE_SEPARATOR = "\n\n"
CANDIDATES = 64  # best-scoring passages considered; a budget rarely holds more


@dataclass(frozen=True)
class ReadingConfig:
    passage_tokens: int = 200  # about how long each passage is (an estimate; see documents.passages)
    budget_tokens: int = 2048  # of document text read for one question, location headers included

    def __post_init__(self) -> None:
        if not 8 <= self.passage_tokens <= self.budget_tokens:
            raise ValueError(f"passage_tokens must be at least 8 and at most budget_tokens "
                             f"({self.passage_tokens}, {self.budget_tokens})")


# SmolLM2-135M-Instruct answers from a short context only (a 68-token prompt right, 178 wrong; a 48-token passage
# of the fact among filler sentences wrong in tests/test_passages.py), and `python -m bench reading` found it
# right 5/5 at 32:80 (docs/BENCHMARKS.md): it reads small passages, the best one and the first, ~80 tokens.
# A larger model reads a tenth of its window.
SMALL_MODEL_READING = ReadingConfig(passage_tokens=32, budget_tokens=80)


def default_reading(max_context: int, parameters: int | None = None) -> ReadingConfig:
    """The reading budget for a model: SMALL_MODEL_READING below 500M parameters, else a tenth of the window
    (at least 1,024 tokens) in passages of 200 tokens."""
    if parameters is not None and parameters < 500_000_000:
        return SMALL_MODEL_READING
    return ReadingConfig(passage_tokens=200, budget_tokens=max(1024, max_context // 10))


@dataclass(frozen=True)
class Reading:
    document: Document  # the original with `text` the passages read and `read` the description
    passages: tuple[Passage, ...]  # in document order
    description: str  # 'report.pdf: pages 1, 36-38'
    tokens: int  # of the passages' text as read (headers included)


def window_note(document_tokens: int, room: int, window: int) -> str | None:
    """The card's line for a document that does not fit the `room` left in the window (None: it is read whole):
    '31,200 tokens, 3.8x this model's window: the passages nearest each question will be read'."""
    if document_tokens <= room:
        return None
    return (f"{document_tokens:,} tokens, {document_tokens / window:.1f}x this model's window: "
            f"the passages nearest each question will be read")


def passage_block(passage: Passage) -> str:
    return f"[{passage.location}]\n{passage.text}"


def read_for_question(index: PassageIndex, document: Document, question: str, config: ReadingConfig,
                      count_tokens: Callable[[str], int]) -> Reading:
    """The passages to read for `question`: the first passage and the best-scoring ones, within the budget.

    The best match comes before the first passage when both do not fit; where nothing matches the
    question, the document is read from its beginning. At least one passage is read, even one longer than
    the budget (passage lengths are estimates until counted)."""
    passages = index.passages()
    ranked = index.best(question, CANDIDATES)
    order = ranked[:1] + [0] + ranked[1:] if ranked else list(range(len(passages)))
    chosen: dict[int, Passage] = {}
    used = 0
    for number in dict.fromkeys(order):
        cost = count_tokens(passage_block(passages[number])) + (count_tokens(PASSAGE_SEPARATOR) if chosen else 0)
        if used + cost <= config.budget_tokens:
            chosen[number], used = passages[number], used + cost
        elif not ranked:
            break  # reading from the beginning: stop at the first passage that does not fit
    if not chosen:  # the budget is smaller than any passage in real tokens: read the best one anyway
        chosen[order[0]] = passages[order[0]]
        used = count_tokens(passage_block(passages[order[0]]))
    read = tuple(chosen[n] for n in sorted(chosen))
    text = PASSAGE_SEPARATOR.join(passage_block(p) for p in read)
    description = describe_read(document.name, read)
    return Reading(dataclasses.replace(document, text=text, page_starts=None, read=description), read, description,
                   used)
