"""A stored session bound to the engine: restore its KV pool, run turns, persist every turn.

    chat = ChatSession.open(store, engine, session_id, progress=print)
    print(chat.restore.tokens_restored, "tokens restored in", chat.restore.seconds, "s")
    for event in chat.send("Summarise our plan.", SamplingConfig(max_new_tokens=200)):
        print(event.text, end="")
    chat.close()

Durability: the user's message is committed before generation starts. Once the prompt has been read (the
first token came) the reply is stored, then updated as it streams (every REPLY_SAVE_SECONDS or
REPLY_SAVE_TOKENS). The prompt's KV rows are copied out of the engine at the first token and the reply's
rows at each of those updates, after its text, and each is written as a chunk on a background thread, so
neither the first token nor the decode loop waits for their int8 encoding and the disk (a save finding the
previous write still going skips its rows; the next takes them). At the turn's end (or Stop, or a failure)
the reply's final text is committed and its rows written whole as one chunk in place of the streamed ones;
that write, a reload and `close` first wait for the background one. A crash mid-turn therefore loses only
the reply's last save interval: the disk holds no KV rows for reply text it lacks (but for the last few
characters the stream holds back, a half character or a stop string's start, whose rows the next turn
truncates), and the next turn reads the stored text beyond the last chunk and the new message, not the
prompt or the reply so far.
Chunk files are made durable before the database rows that name them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from documents import Document, attachment_record, attachment_text, message_with_attachments
from infinigen_core import GenerationEvent, SamplingConfig, chat_token_ids, generate
from infinigen_core.generation import chat_token_ids_many
from infinigen_core.prefix import common_prefix_length

from .chunk_writer import SessionChunks
from .errors import ContextWindowError, SessionError
from .lock import SessionLock, session_lock
from .restore import ChunkChecksums, ChunkChoice, missing_cache, read_chunks, which_chunks
from .snapshots import ChunkError, ChunkRecord, damage_reason, read_chunk
from .store import Message, SessionStore
from .stored_conversation import StoredConversation, conversation  # noqa: F401  (callers import it from here)

Progress = Callable[[int, int], None]
# room the next reply needs at least: the one reserve of the one window rule (WindowCheck.of), which the page
# and the API both apply, so a message near the window's edge gets the same answer from both
REPLY_RESERVE_TOKENS = 64
# a streaming reply's text, and its KV rows in the background, are stored every second, or every
# REPLY_SAVE_TOKENS tokens where decoding is faster, so a crash loses less (each save is a database commit)
REPLY_SAVE_SECONDS = 1.0
REPLY_SAVE_TOKENS = 64
RECENT_CONVERSATIONS = 4  # tokenized conversations a session remembers (ChatSession._conversations_ids)


@dataclass(frozen=True)
class RestoreReport:
    tokens_restored: int  # KV rows read from disk
    tokens_prefilled: int  # tokens recomputed because chunks were missing or unusable
    seconds: float
    rebuilt: bool
    reason: str  # why the pool was rebuilt ("" when it was not)


@dataclass
class NewMessage:
    """A message about to be stored: who said it, what, the token span it takes in the templated conversation,
    and its attachments' records (the store takes it as a row)."""

    role: str
    content: str
    token_start: int
    token_end: int
    attachments: list[dict]

    def row(self) -> tuple:
        return self.role, self.content, self.token_start, self.token_end, self.attachments


@dataclass(frozen=True)
class WindowCheck:
    fits: bool
    needed_tokens: int
    window: int
    droppable_turns: int

    @classmethod
    def of(cls, prompt_tokens: int, window: int, user_turns: int) -> "WindowCheck":
        """The window rule: the prompt and a short reply (REPLY_RESERVE_TOKENS) fit the model's window."""
        needed = prompt_tokens + REPLY_RESERVE_TOKENS
        return cls(needed <= window, needed, window, max(user_turns - 1, 0))

    def explain(self, attached: bool = False, passages: bool = False) -> str:
        """Why the message cannot be sent, by how much, and what to do instead: the one wording of both faces
        (`passages`: its files are read by passages already, so a smaller part of a file would not help)."""
        over = self.needed_tokens - self.window
        if passages:
            return (f"This message needs {self.needed_tokens:,} tokens (with room for a short reply) even with its "
                    f"files read by passages, {over:,} more than the model's window of {self.window:,}: the "
                    f"question and the earlier turns take the room. Shorten the question, drop the oldest turns "
                    f"({self.droppable_turns} can go; the system prompt stays), or start a new session. Nothing was "
                    f"read or sent.")
        if attached:
            return (f"This message with its attachments needs {self.needed_tokens:,} tokens (with room for a short "
                    f"reply), {over:,} more than the model's window of {self.window:,}. Attach a smaller part of "
                    f"the file (about {over:,} tokens less), start a new session, or load a model with a longer "
                    f"window. Nothing was read or sent.")
        return (f"This message would bring the conversation to {self.needed_tokens:,} tokens (with room for a short "
                f"reply), {over:,} beyond the model's window of {self.window:,}. Start a new session, or drop the "
                f"oldest turns ({self.droppable_turns} can go; the system prompt stays). Nothing was sent.")


def reply_prompt_ids(tokenizer, turns: list[dict], window: int) -> list[int]:
    """`turns` templated for the model's reply, which must fit the window with room for a short reply; raises
    ContextWindowError (its check says how many turns could go).

        ids = reply_prompt_ids(engine.tokenizer, conversation("Be brief.", [("user", "Hi")]), engine.max_context)
    """
    return checked_reply_prompt(chat_token_ids(tokenizer, turns, add_generation_prompt=True), turns, window)


def checked_reply_prompt(prompt_ids: list[int], turns: list[dict], window: int) -> list[int]:
    """`prompt_ids` (`turns` templated for the reply) if they and a short reply fit the window, else
    ContextWindowError."""
    check = WindowCheck.of(len(prompt_ids), window, sum(1 for turn in turns if turn["role"] == "user"))
    if not check.fits:
        raise ContextWindowError(check)
    return prompt_ids


class ChatSession(StoredConversation):
    def __init__(self, store: SessionStore, engine, session_id: str, lock: SessionLock) -> None:
        self.store, self.engine, self.id, self._lock = store, engine, session_id, lock
        self._chunks = SessionChunks(store, session_id)  # its chunks on disk, kept in step with the engine
        self._recent_ids: dict[tuple, list[int]] = {}  # conversation -> its token ids, newest first
        self.restore = RestoreReport(0, 0, 0.0, False, "")
        self.last_read_tokens = 0  # tokens of the last turn's prompt that the model read (the rest was cached)

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, store: SessionStore, engine, session_id: str, progress: Progress | None = None) -> "ChatSession":
        store.get(session_id)  # a clear error for an unknown id
        lock = session_lock(store.data_dir, session_id).acquire()
        try:
            store.touch(session_id)
            session = cls(store, engine, session_id, lock)
            session.restore = session._restore(progress)
        except BaseException:
            lock.release()
            raise
        return session

    def close(self) -> None:
        try:
            self._chunks.wait()
        finally:
            self._lock.release()

    def __enter__(self) -> "ChatSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reload(self, progress: Progress | None = None) -> RestoreReport:
        """Read this session's KV back into the engine after another session used it (the engine holds one
        conversation at a time)."""
        self.restore = self._restore(progress)
        return self.restore

    def import_prefix(self, record: ChunkRecord, up_to: int) -> int:
        """Take the rows [record.start, up_to) from another session's chunk (checked like our own) instead of
        recomputing them; they are saved with this session's next chunk. Returns the tokens taken (0 when the
        chunk does not follow this session's cache or cannot be read)."""
        engine = self.engine
        if record.start != engine.num_tokens or not record.start < up_to <= record.end:
            return 0
        try:
            rows = read_chunk(self.store.data_dir, record, engine.kv_signature(), engine.partial_key_digests())
        except ChunkError:
            return 0  # the tokens are simply read again
        engine.import_rows([rows])
        engine.truncate(up_to)
        return up_to - record.start

    def _restore(self, progress: Progress | None) -> RestoreReport:
        """Read back the chunks this model can use, then re-read what they do not hold."""
        started = time.perf_counter()
        self._chunks.wait()  # what is read back must include the chunk still being written
        engine, signature = self.engine, self.engine.kv_signature()
        engine.reset()
        self.store.remove_leftovers(self.id)
        choice = which_chunks(self.store, self.id, engine)
        checksums = ChunkChecksums()
        tensors, read_up_to, problem = read_chunks(self.store, choice, signature, progress,
                                                   engine.partial_key_digests(), checksums)
        restored = engine.import_rows(tensors) if tensors else 0
        del tensors  # views of the mapped files: let them go (the checksums' thread holds its own; the pool those of
        # the sliding layers' rows it left in their chunks: pool_restore.py)
        damaged_chunk = checksums.first_damaged()
        if damaged_chunk is not None:  # its rows and those after it go again: read anew below
            engine.truncate(damaged_chunk.start)
            restored, read_up_to, problem = damaged_chunk.start, damaged_chunk.start, damage_reason(damaged_chunk)
        if problem:
            self.store.drop_chunks_from(self.id, read_up_to if restored else -1)
        self._chunks.saved_ids = list(engine.token_ids)
        problem = problem or missing_cache(self.store, self.id, restored, choice)
        prefilled = self._reread(problem, choice, progress)
        return RestoreReport(restored, prefilled, time.perf_counter() - started, bool(problem), problem)

    def _reread(self, problem: str, choice: ChunkChoice, progress: Progress | None) -> int:
        """Re-read what the cache lacks: everything after a problem, or, for a cache brought back from an
        earlier visit of this model, what was said under another model since (the common prefix is kept).
        Returns the tokens read."""
        engine = self.engine
        if not self.messages or not (problem or choice.unparked):
            return 0  # a whole restore: the conversation is not tokenized again (~0.05 s at 32k tokens)
        wanted = self._conversation_ids()
        if not wanted or (not problem and wanted == engine.token_ids):
            return 0
        before = engine.num_tokens
        engine.sync_to(wanted[: engine.max_context], progress)
        self._chunks.persist(self.engine)
        return engine.num_tokens - min(before, engine.num_tokens)

    # ------------------------------------------------------------------ conversation (its messages: StoredConversation)
    def _conversation_ids(self, messages: list[Message] | None = None, extra_user: str | None = None,
                          generation_prompt: bool = False) -> list[int]:
        return self._conversations_ids([(messages, extra_user, generation_prompt)])[0]

    def _conversations_ids(self, asked: list[tuple[list[Message] | None, str | None, bool]]) -> list[list[int]]:
        """Token ids of the conversation, one list per (messages, extra user message, generation prompt) asked
        for ([] where it has no turn). A turn tokenizes the same long conversation more than once (window
        check, prompt, the message's start): the last few are remembered, and those not yet are tokenized
        together (`chat_token_ids_many`)."""
        keyed = []
        for messages, extra_user, generation_prompt in asked:
            turns = self._conversation(messages, extra_user)
            keyed.append((turns, (tuple((turn["role"], turn["content"]) for turn in turns), generation_prompt)))
        missing = {key: turns for turns, key in keyed if turns and key not in self._recent_ids}
        if missing:
            fresh = chat_token_ids_many(self.engine.tokenizer, [(turns, key[1]) for key, turns in missing.items()])
            kept = list(self._recent_ids.items())[: max(0, RECENT_CONVERSATIONS - len(missing))]
            self._recent_ids = {**dict(zip(missing, fresh)), **dict(kept)}
        return [list(self._recent_ids[key]) if turns else [] for turns, key in keyed]

    def check_window(self, text: str = "", messages: list[Message] | None = None) -> WindowCheck:
        """Whether a user message `text` and a short reply fit the model's window."""
        prompt = len(self._conversation_ids(messages, text, generation_prompt=True))
        history = self.messages if messages is None else messages
        return WindowCheck.of(prompt, self.engine.max_context, sum(1 for m in history if m.role == "user"))

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids the model reads for a user message `text` (as `user_message` makes it) and its reply."""
        return self._conversation_ids(extra_user=text, generation_prompt=True)

    def user_message(self, text: str, attachments: list[Document] | tuple[Document, ...] = ()) -> tuple[str, list[dict]]:
        """The stored content of a message (the documents' text before the question) and its attachment records."""
        return message_with_attachments(text.strip(), attachments), self._records(attachments)

    def _records(self, attachments: Sequence[Document]) -> list[dict]:
        """What the message keeps of its attachments (for its card), with each one's tokens."""
        tokenizer = self.engine.tokenizer
        return [attachment_record(d, len(tokenizer.encode(attachment_text(d), add_special_tokens=False))
                                  if tokenizer is not None else None) for d in attachments]

    def send(self, text: str, sampling: SamplingConfig = SamplingConfig(), cancel=None,
             on_prefill_progress: Progress | None = None,
             attachments: list[Document] | tuple[Document, ...] = ()) -> Iterator[GenerationEvent]:
        """Store the user's message (after the text of its attached documents), stream the reply, store it and
        its KV rows (also when stopped)."""
        text, records = self.user_message(text, attachments)
        if not text:
            raise SessionError("the message is empty: type something first")
        messages = self.messages  # read once: each read queries every stored message
        prompt_ids, before = self._conversations_ids([(messages, text, True), (messages, None, False)])
        check = self.check_window(text, messages)  # the prompt's ids, remembered just above
        if not check.fits:
            raise ContextWindowError(check, attached=bool(attachments))
        start = len(before)
        self.store.add_message(self.id, "user", text, start, len(prompt_ids), records)
        yield from self._reply(prompt_ids, sampling, cancel, on_prefill_progress)

    def extend(self, turns: list[tuple[str, str]], sampling: SamplingConfig = SamplingConfig(), cancel=None,
               on_prefill_progress: Progress | None = None,
               documents: Sequence[Sequence[Document]] = ()) -> Iterator[GenerationEvent]:
        """Append (role, content) messages as an API client sends them, then stream and store the reply to the
        whole conversation. Checked against the window first; the messages are stored in one transaction.
        `documents`, per turn where given, are the files whose text its content holds (kept as its cards)."""
        before = turns_so_far = self._conversation()
        conversations = []
        for role, content in turns:
            if role not in ("user", "assistant"):
                raise SessionError(f"a stored message is from the user or the assistant, not {role!r}")
            turns_so_far = turns_so_far + [{"role": role, "content": content}]
            conversations.append(turns_so_far)
        # the conversation before, after each new message, and the reply's prompt: tokenized together
        asked = [(before, False)] * bool(before) + [(after, False) for after in conversations] + [(turns_so_far, True)]
        *spans, prompt_ids = chat_token_ids_many(self.engine.tokenizer, asked)
        checked_reply_prompt(prompt_ids, turns_so_far, self.engine.max_context)
        ends = [len(ids) for ids in spans] if before else [0] + [len(ids) for ids in spans]
        new = [NewMessage(role, content, ends[index], ends[index + 1],
                          self._records(documents[index]) if index < len(documents) else [])
               for index, (role, content) in enumerate(turns)]
        if new and new[-1].role == "user":
            new[-1].token_end = len(prompt_ids)  # like `send`: a user message's span ends after the reply's opening
        if new:
            self.store.add_messages(self.id, [message.row() for message in new])
        yield from self._reply(prompt_ids, sampling, cancel, on_prefill_progress)

    def regenerate(self, sampling: SamplingConfig = SamplingConfig(), cancel=None,
                   on_prefill_progress: Progress | None = None) -> Iterator[GenerationEvent]:
        """Replace the reply to the last user message (or answer a message left without one)."""
        messages = self.messages
        last_user = self._last_user_message(messages, "there is no message to answer yet")
        if 0 < last_user.token_end <= self.engine.num_tokens:
            self.engine.truncate(last_user.token_end)  # keep the prompt, drop the old reply
        prompt_ids = self._conversation_ids([m for m in messages if m.position <= last_user.position],
                                            generation_prompt=True)
        # the stored old reply goes only once a new one starts: a failure or an instant Stop keeps it
        yield from self._reply(prompt_ids, sampling, cancel, on_prefill_progress,
                               replaces_from=last_user.position + 1)

    def edit_last_user(self, text: str, sampling: SamplingConfig = SamplingConfig(), cancel=None,
                       on_prefill_progress: Progress | None = None) -> Iterator[GenerationEvent]:
        """Replace the last user message (and its reply) with `text` and answer it."""
        if not text.strip():
            raise SessionError("the edited message is empty: type something first")
        last_user = self._last_user_message(self.messages, "there is no message to edit yet")
        check = self.check_window(text, [m for m in self.messages if m.position < last_user.position])
        if not check.fits:
            raise ContextWindowError(check)
        self.store.delete_messages_from(self.id, last_user.position)
        if 0 < last_user.token_start <= self.engine.num_tokens:
            self.engine.truncate(last_user.token_start)
        yield from self.send(text, sampling, cancel, on_prefill_progress)

    def _reply(self, prompt_ids: list[int], sampling: SamplingConfig, cancel, on_prefill_progress: Progress | None,
               replaces_from: int | None = None) -> Iterator[GenerationEvent]:
        """Stream a reply and store it. A reply exists once a token came (or the model ended at once); then,
        and not before, messages from `replaces_from` on (an old reply) are deleted, the prompt's KV rows are
        saved and the reply is stored, its text updated as it streams."""
        text, reply_id, saved_at, saved_tokens = "", None, 0.0, 0
        cached = common_prefix_length(self.engine.token_ids, prompt_ids)
        self.last_read_tokens = len(prompt_ids) - min(cached, max(len(prompt_ids) - 1, 0))
        try:
            for event in generate(self.engine, prompt_ids, sampling, cancel, on_prefill_progress):
                text = event.full_text
                if reply_id is None and (event.token_id is not None or event.finish_reason == "eos"):
                    reply_id, saved_at = self._start_reply(prompt_ids, text, replaces_from), time.monotonic()
                    saved_tokens = self.engine.num_tokens
                elif reply_id is not None and (time.monotonic() - saved_at >= REPLY_SAVE_SECONDS
                                               or self.engine.num_tokens - saved_tokens >= REPLY_SAVE_TOKENS):
                    # throttled: a commit waits for the disk, and the decode loop must not wait on it per token
                    self.store.update_message(reply_id, text, self.engine.num_tokens)
                    self._chunks.stream(self.engine)  # after the text: the disk never holds rows whose text it lacks
                    saved_at, saved_tokens = time.monotonic(), self.engine.num_tokens
                yield event
        finally:  # also when the consumer stops early or generation fails: keep what was generated
            if reply_id is not None:
                self.store.update_message(reply_id, text, self.engine.num_tokens)
            self._chunks.persist(self.engine, boundary=len(prompt_ids))

    def _start_reply(self, prompt_ids: list[int], text: str, replaces_from: int | None) -> int:
        """The first token came: drop the reply it replaces, store the reply begun, and save the prompt's KV
        rows (the engine holds just those now, so they become their own chunk); returns the reply's id."""
        if replaces_from is not None:
            self.store.delete_messages_from(self.id, replaces_from)
        reply_id = self.store.add_message(self.id, "assistant", text, len(prompt_ids), self.engine.num_tokens)
        self._chunks.persist(self.engine, boundary=len(prompt_ids), background=True)
        return reply_id
