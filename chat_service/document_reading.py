"""Documents longer than the window, for both faces: a message's attached documents that do not fit are read
by passages (the first one and those nearest the question, within the model's reading budget).

    reader = DocumentReader(store.data_dir / "passages")
    documents = reader.for_page(chat, "What does it say about costs?", documents)   # before the page sends
    asked = reader.for_api(asked, engine)                                          # before the API templates

A document read by passages carries `read` ('report.pdf: pages 1, 36-38'), which its stored record keeps
(documents.attachment_record), so the card, a reopened session and an export all say what was read. A file
attached again in the same conversation whose text (whole, or the same passages) an earlier message holds is
not read again: the new message holds a short reference instead (documents.fitting.read_above).
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from documents import Document, message_with_attachments
from documents.fitting import fit_message
from documents.passage_index import PassageIndex
from documents.reading import ReadingConfig, default_reading, read_for_question
from infinigen_core import ContextOverflowError
from sessions import ChatSession, ContextWindowError
from sessions.chat import conversation, reply_prompt_ids

from .api_turns import Conversation
from .errors import UserError
from .remote_chat import OpenChat


class DocumentReader:
    def __init__(self, folder: Path) -> None:
        self.folder = folder  # one FTS5 index per file (by its sha256), shared by every session
        self._parameters: dict[int, tuple[object, int]] = {}

    def config(self, engine) -> ReadingConfig:
        """The reading budget for the loaded model (documents.reading.default_reading)."""
        known = self._parameters.get(id(engine))
        if known is None or known[0] is not engine:
            known = self._parameters[id(engine)] = (engine, sum(p.numel() for p in engine.model.parameters()))
        return default_reading(engine.max_context, known[1])

    def read(self, engine, document: Document, question: str) -> Document:
        """`document` with only the passages read for `question` as its text."""
        config = self.config(engine)
        try:
            index = PassageIndex.open(self.folder, document, config.passage_tokens)
        except (OSError, sqlite3.Error) as error:  # a full disk, an unwritable data directory
            raise UserError(f"{document.name} is too long to read whole, and its passages could not be indexed "
                            f"in {self.folder} ({error}). Free some disk space, or attach a shorter part.") from None
        try:
            return read_for_question(index, document, question, config, _counter(engine.tokenizer)).document
        finally:
            index.close()

    def for_page(self, chat: OpenChat, text: str, documents: Sequence[Document]) -> tuple[Document, ...]:
        """The page's message `text` with `documents`: those that do not fit the open session read by passages.
        A session on a remote server is sent whole: the app has no tokenizer for it, the server checks its window."""
        if not isinstance(chat, ChatSession):
            return tuple(documents)
        question = text.strip()
        earlier = [message.content for message in chat.messages if message.role == "user" and message.attachments]
        return fit_message(question, documents, lambda content: chat.check_window(content).fits,
                           lambda document: self.read(chat.engine, document, question), earlier)

    def for_api(self, asked: Conversation, engine) -> Conversation:
        """The API's conversation with each user turn's files that do not fit the window (with the turns before
        it) read by passages for that turn's question. Earlier turns come out as they did when they were last,
        so a client that sends the conversation again continues the stored session."""
        turns: list[tuple[str, str]] = []
        documents: list[tuple[Document, ...]] = []
        for number, (role, content) in enumerate(asked.turns):
            attached = asked.documents[number] if number < len(asked.documents) else ()
            if role == "user" and attached:
                question = asked.questions[number]

                earlier = [said for (role, said), files in zip(turns, documents) if role == "user" and files]
                attached = fit_message(question, attached, self._api_window(engine, asked.system, turns),
                                       self._reader(engine, question), earlier)
                content = message_with_attachments(question, attached)
            turns.append((role, content))
            documents.append(tuple(attached))
        return dataclasses.replace(asked, turns=tuple(turns), documents=tuple(documents))


    def _reader(self, engine, question: str) -> Callable[[Document], Document]:
        return lambda document: self.read(engine, document, question)

    @staticmethod
    def _api_window(engine, system: str, turns: list[tuple[str, str]]) -> Callable[[str], bool]:
        """Whether a user message after `turns` fits the window (the API's rule, as for a whole request)."""
        before = list(turns)
        return lambda message: _fits(engine, conversation(system, [*before, ("user", message)]))


def _fits(engine, turns: list[dict]) -> bool:
    try:
        reply_prompt_ids(engine.tokenizer, turns, engine.max_context)
    except (ContextWindowError, ContextOverflowError):
        return False
    return True


def _counter(tokenizer):
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
