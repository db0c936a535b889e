"""Documents longer than the window: passages with their pages or lines, a BM25 index per file, a budgeted read."""

import hashlib
import random

import pytest
from test_documents import docx_bytes, paragraph, pdf_bytes

from documents import Document, convert_bytes
from documents.passage_index import PassageIndex
from documents.passages import Passage, describe_read, split_passages
from documents.reading import ReadingConfig, default_reading, read_for_question, window_note

FACT = "The harbour master's cat is named Biscuit."
QUESTION = "What is the harbour master's cat named?"
FILLER = ("the ledger of the mill recorded grain barley wages carts weather river bridge tolls market "
         "merchants sold cloth wool salt candles lamps oil the clerk wrote each entry with care and "
         "the season turned toward autumn while the roads grew muddy and slow")
WORDS = tuple(FILLER.split(" "))


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "."


def approx_tokens(text: str) -> int:
    return len(text) // 4 + 1


def long_text(lines: int, fact_line: int, seed: int = 0, own_paragraph: bool = False) -> str:
    """`lines` lines of filler in paragraphs of five, the fact on line `fact_line` (1-based), in a paragraph of
    its own (blank lines around it) when `own_paragraph`."""
    rng = random.Random(seed)
    out = []
    for number in range(1, lines + 1):
        blank = number % 6 == 0 or (own_paragraph and abs(number - fact_line) == 1)
        out.append(FACT if number == fact_line else ("" if blank else sentence(rng)))
    return "\n".join(out)


def text_document(text: str, name: str = "notes.txt") -> Document:
    return Document(name=name, kind="text", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                    size_bytes=len(text.encode()))


def test_a_40k_token_text_file_reads_the_planted_line_among_a_few(tmp_path):
    text = long_text(2800, fact_line=2213)
    assert approx_tokens(text) > 40_000
    document = text_document(text)
    config = ReadingConfig(passage_tokens=200, budget_tokens=700)
    index = PassageIndex.open(tmp_path, document, config.passage_tokens)
    reading = read_for_question(index, document, QUESTION, config, approx_tokens)
    assert FACT in reading.document.text
    assert reading.passages[0].index == 0  # the beginning, as title and outline
    assert [p.index for p in reading.passages] == sorted(p.index for p in reading.passages)
    assert reading.tokens <= config.budget_tokens and approx_tokens(reading.document.text) <= config.budget_tokens
    holding = next(p for p in reading.passages if FACT in p.text)
    assert holding.first_line <= 2213 <= holding.last_line
    assert text.split("\n")[holding.first_line - 1] == holding.text.split("\n")[0]  # line numbers are exact
    assert reading.description.startswith("notes.txt: lines 1-") and f"-{holding.last_line}" in reading.description
    assert f"[lines {holding.first_line}-{holding.last_line}]\n" in reading.document.text


def pdf_of_pages(pages: int, fact_page: int) -> bytes:
    rng = random.Random(1)
    return pdf_bytes([[FACT if (page == fact_page and row == 20) else sentence(rng) for row in range(34)]
                      for page in range(1, pages + 1)])


def test_a_40k_token_pdf_reads_the_planted_page_and_names_it(tmp_path):
    data = pdf_of_pages(80, fact_page=57)
    document = convert_bytes("report.pdf", data)
    assert document.pages == 80 and approx_tokens(document.text) > 40_000
    config = ReadingConfig(passage_tokens=200, budget_tokens=600)
    index = PassageIndex.open(tmp_path, document, config.passage_tokens)
    passages = index.passages()
    assert [p.page for p in passages] == sorted(p.page for p in passages) and passages[-1].page == 80
    assert all("Biscuit" not in p.text for p in passages if p.page != 57)
    reading = read_for_question(index, document, QUESTION, config, approx_tokens)
    assert 57 in {p.page for p in reading.passages} and "named Biscuit" in reading.document.text  # PDFium: ’
    assert reading.description.startswith("report.pdf: pages 1, ") and "[page 57]\n" in reading.document.text
    ranges = [r.split("-") for r in reading.description.split(": pages ")[1].split(", ")]
    assert any(int(r[0]) <= 57 <= int(r[-1]) for r in ranges)


def test_a_docx_keeps_the_pages_word_recorded(tmp_path):
    rng = random.Random(2)
    pages = [[sentence(rng) for _ in range(6)] for _ in range(12)]
    pages[8][3] = "The harbour master keeps a cat named Biscuit."
    rendered_break = '<w:p><w:r><w:lastRenderedPageBreak/><w:t>{}</w:t></w:r></w:p>'
    body = "".join((rendered_break.format(text) if row == 0 and number > 0 else paragraph(text))
                   for number, page in enumerate(pages) for row, text in enumerate(page))
    data = docx_bytes(body, pages=12)
    document = convert_bytes("minutes.docx", data)
    index = PassageIndex.open(tmp_path, document, 40)
    passages = index.passages()
    assert {p.page for p in passages} == set(range(1, 13))
    assert all(p.text.split("\n")[0] in "\n".join(pages[p.page - 1]) for p in passages)  # each on its page
    reading = read_for_question(index, document, QUESTION, ReadingConfig(passage_tokens=40, budget_tokens=120),
                                approx_tokens)
    assert "Biscuit" in reading.document.text and reading.description.startswith("minutes.docx: pages 1, ")
    assert "9" in reading.description.split(": pages ")[1].replace("-", ", ").split(", ")
    without_breaks = docx_bytes("".join(paragraph(t) for page in pages for t in page), pages=12)
    assert {p.page for p in PassageIndex.open(tmp_path / "plain", convert_bytes("plain.docx", without_breaks),
                                              40).passages()} == {None}  # lines, not guessed pages


def test_the_index_is_built_once_per_file_and_rebuilt_when_damaged(tmp_path):
    document = text_document(long_text(300, fact_line=250))
    first = PassageIndex.open(tmp_path, document, 100)
    built = first.path.stat().st_ino  # a rebuild renames a new file into place
    first.close()
    again = PassageIndex.open(tmp_path, document, 100)  # a second chat about the same file
    assert again.path == first.path and again.path.stat().st_ino == built
    assert again.best(QUESTION, 1) and FACT in again.passages()[again.best(QUESTION, 1)[0]].text
    again.close()
    again.path.write_bytes(b"not a database" * 100)
    rebuilt = PassageIndex.open(tmp_path, document, 100)
    assert FACT in rebuilt.passages()[rebuilt.best(QUESTION, 1)[0]].text
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary file left behind
    assert PassageIndex.open(tmp_path, document, 50).path != first.path  # another passage size, another index


def test_a_question_with_no_matching_word_reads_from_the_beginning(tmp_path):
    document = text_document(long_text(600, fact_line=500))
    config = ReadingConfig(passage_tokens=100, budget_tokens=300)
    index = PassageIndex.open(tmp_path, document, config.passage_tokens)
    for question in ("", "zzz qqq", '" OR NEAR( NOT *'):
        reading = read_for_question(index, document, question, config, approx_tokens)
        assert [p.index for p in reading.passages] == list(range(len(reading.passages))) and reading.passages


def test_passages_cut_long_paragraphs_and_keep_every_word():
    text = ("word " * 3000).strip() + "\n\nshort tail"
    passages = split_passages(text_document(text), passage_tokens=100)
    assert all(len(p.text) <= 400 for p in passages) and len(passages) > 30
    assert " ".join(p.text for p in passages).split() == text.split()
    with pytest.raises(ValueError):
        split_passages(text_document(text), passage_tokens=2)


def test_what_was_read_is_described_in_merged_ranges():
    def at(page=None, lines=(1, 1)):
        return Passage(index=0, text="x", first_line=lines[0], last_line=lines[1], page=page)

    assert describe_read("report.pdf", [at(1), at(36), at(37), at(38)]) == "report.pdf: pages 1, 36-38"
    assert describe_read("report.pdf", [at(4)]) == "report.pdf: page 4"
    assert describe_read("notes.txt", [at(lines=(1, 12)), at(lines=(840, 850)), at(lines=(852, 861))]) == \
        "notes.txt: lines 1-12, 840-861"
    assert describe_read("a.md", []) == "a.md: nothing"


def test_the_card_note_and_the_budget_for_a_model():
    assert window_note(31_200, room=7_900, window=8_192) == (
        "31,200 tokens, 3.8x this model's window: the passages nearest each question will be read")
    assert window_note(5_000, room=7_900, window=8_192) is None  # it fits: read whole, as before
    small, large = default_reading(8_192, parameters=135_000_000), default_reading(32_768, parameters=8_000_000_000)
    assert small.budget_tokens < 500 and large.budget_tokens == 3_276
    with pytest.raises(ValueError):
        ReadingConfig(passage_tokens=300, budget_tokens=200)


def test_the_default_model_answers_from_the_passages_of_a_40k_token_document(tmp_path, real_engine):
    """Through the real chat path: the chosen passages are attached in place of the whole text. The fact is a
    short paragraph of its own: the 135M model answers from a short passage, not from one padded with filler
    (a 48-token passage of the fact and three filler sentences made it answer wrongly)."""
    from infinigen_core.config import SamplingConfig
    from sessions import ChatSession, SessionStore

    document = text_document(long_text(2800, fact_line=2213, own_paragraph=True), name="ledger.txt")
    config = default_reading(real_engine.max_context, parameters=135_000_000)
    index = PassageIndex.open(tmp_path / "passages", document, config.passage_tokens)
    count = lambda text: len(real_engine.tokenizer.encode(text, add_special_tokens=False))
    reading = read_for_question(index, document, QUESTION, config, count)
    assert reading.tokens <= config.budget_tokens and FACT in reading.document.text
    store = SessionStore(tmp_path / "data")
    with ChatSession.open(store, real_engine, store.create("Ledger")) as chat:
        events = list(chat.send(QUESTION, SamplingConfig(max_new_tokens=12), attachments=[reading.document]))
    assert "biscuit" in events[-1].full_text.lower()
    stored = store.messages(chat.id)[0]
    assert "Biscuit" in stored.content and stored.attachments[0]["name"] == "ledger.txt"
