"""What the page writes about the app's state: the status line and the sidebar's session labels and details."""

from __future__ import annotations

import html
import time
from collections.abc import Sequence

from chat_service import ChatService
from documents import Document
from documents.fitting import is_read_above
from documents.reading import window_note
from infinigen_core import chat_token_ids
from sessions import ChatSession, Message, SessionSummary, format_size
from sessions.chat import conversation
from sessions.overflow import OVERFLOW_LABEL, OVERFLOW_POLICIES

from .panels import layer_ranges, windows_text

METER_LISTED = 5  # dropped turns the context meter names; the rest are counted


def session_choices(summaries: list[SessionSummary], remote: bool = False) -> list[tuple[str, str]]:
    """Short labels that fit the sidebar: title, tokens, KV size on disk or "re-read" when its KV is not on
    disk (opening it re-reads the text) or "server" when a remote server holds the KV (`remote`), last used (the
    open session's details sit below)."""
    choices = []
    for s in summaries:
        title = s.title if len(s.title) <= 20 else s.title[:19] + "…"
        used = time.strftime("%d %b", time.localtime(s.last_used))
        source = "API · " if s.origin == "api" else ""  # a conversation an OpenAI-API client had
        disk = "server" if remote else format_size(s.bytes_on_disk) if s.reopens_instantly else "re-read"
        choices.append((f"{source}{title} · {s.token_count:,} tok · {disk} · {used}", s.id))
    return choices


def find(summaries: list[SessionSummary], session_id: str | None) -> SessionSummary | None:
    return next((s for s in summaries if s.id == session_id), None)


def session_details(summary: SessionSummary | None, remote: bool = False) -> str:
    """The open session's line below the list; `remote`: a remote server generates (and holds the KV)."""
    if summary is None:
        return ""
    used = time.strftime("%d %b %Y %H:%M", time.localtime(summary.last_used))
    source = "from the API · " if summary.origin == "api" else ""
    if remote:
        reopening = "its KV cache is the server's (its prefix cache): opening it reads nothing here"
    elif summary.reopens_instantly:
        reopening = "reopens instantly (its KV cache is on disk)"
    elif summary.kv_dropped:
        reopening = "its KV cache was dropped to stay within the disk limit: opening it re-reads the text"
    else:
        reopening = "opening it re-reads the text (its KV cache is not on disk)"
    return (f"{source}{summary.token_count:,} tokens · {summary.message_count} messages · "
            f"{format_size(summary.bytes_on_disk)} on disk · last used {used} · {reopening}")


def _time_left(progress) -> str:
    """', about 12 s left' from the reading rate so far (nothing until a first chunk is read)."""
    elapsed = time.perf_counter() - progress.started
    if progress.done <= 0 or elapsed <= 0 or progress.done >= progress.total:
        return ""
    return f", about {(progress.total - progress.done) * elapsed / progress.done:.0f} s left (Stop keeps what was read)"


def status_text(service: ChatService) -> str:
    host = service.host
    if not host.is_ready() and host.engine is None:
        waiting = service.page_turns.waiting_for_model
        note = (" Your message waits for the model; it is sent as soon as the model is ready." if waiting else "")
        return f"**Starting:** {host.status}{note}"
    progress = service.turns.progress
    if progress.phase == "restore":
        return f"**Opening the session:** {progress.done:,} / {progress.total:,} tokens of KV cache..."
    if progress.phase == "prefill" and progress.total:
        return f"**Reading your message:** {progress.done:,} / {progress.total:,} tokens{_time_left(progress)}..."
    if progress.phase == "prefill":
        return "**Waiting for the backend...**" if host.remote else "**Reading your message...**"
    if progress.phase == "generating":
        return f"**Generating:** {progress.tokens} tokens, {progress.tokens_per_second():.1f} tokens/s"
    return f"**{host.status}.** {service.pages.restore_message}{disk_limit_note(service)}"


def disk_limit_note(service: ChatService) -> str:
    """Said while the open sessions alone keep the saved KV caches over the disk limit (nothing else can go)."""
    over = service.store.over_disk_limit
    if over is None:
        return ""
    used, limit = over
    return (f" **KV cache on disk over its limit:** {format_size(used)} used, limit {format_size(limit)}; "
            f"the open session's KV is kept while it is open.")


def search_snippets(hits, text: str) -> str:
    """HTML for the sidebar's search results: each chat's title and the matching message's snippet (the store
    escapes it and marks the words), or a line saying that nothing matched."""
    if not text.strip():
        return ""
    if not hits:
        return f"<p>No saved chat holds “{html.escape(text.strip())}”.</p>"
    rows = "".join(f"<li><b>{html.escape(hit.title)}</b><br>{hit.snippet}</li>" for hit in hits)
    return f"<ul class='ig-search-hits'>{rows}</ul>"


def context_meter(service: ChatService, messages: Sequence[Message] | None = None,
                  summary: SessionSummary | None = None) -> str:
    """The open session's share of the model's window, the overflow setting, and the turns dropped from it to
    fit ('3 turns out of the window: “…”, …'), which the model no longer reads. Empty for a remote session
    (the server counts its own tokens) and while no model is loaded. `messages` and `summary` are the open
    session's as the caller read them (read here when not given). The count is the last message's stored
    `token_end` (what the model read up to the end of the last turn); the conversation is tokenized only
    while the spans are unknown (turns dropped since the last turn: replace_messages)."""
    chat, engine = service.open_sessions.page, service.host.engine
    if not isinstance(chat, ChatSession) or engine is None:
        return ""
    messages = chat.messages if messages is None else messages
    if messages and messages[-1].token_end >= 0:
        used = messages[-1].token_end
    else:
        system = summary.system_prompt if summary is not None and summary.id == chat.id else chat.system_prompt
        turns = conversation(system, [(m.role, m.content) for m in messages])
        used = len(chat_token_ids(engine.tokenizer, turns)) if turns else 0
    window = engine.max_context
    policy = OVERFLOW_POLICIES[service.settings.current.overflow]
    meter = f"Context: {used:,} of {window:,} tokens ({100 * used / window:.0f}%){layers_read(engine, used)} · " \
            f"{OVERFLOW_LABEL.lower()}: {policy.lower()}."
    dropped = service.page_turns.out_of_window.listed(chat.id)
    if dropped:
        named = ", ".join(f"“{html.escape(question)}”" for question in dropped[:METER_LISTED])
        more = f" and {len(dropped) - METER_LISTED} more" if len(dropped) > METER_LISTED else ""
        meter += f" **{len(dropped)} turn{'s' if len(dropped) != 1 else ''} out of the window** (dropped to fit; " \
                 f"the model no longer reads them): {named}{more}."
    return meter


def layers_read(engine, used: int) -> str:
    """For a model with sliding-window layers, what each kind of layer reads of the `used` tokens (' · 15 of 18
    layers read only the last 512 tokens (a sliding window); InfiniGen fetches up to 2,015 of the 20,143 on
    the other 3 (global: 5, 11, 17)'); empty for a model without."""
    adapter = engine.adapter
    sliding = [layer for layer in range(adapter.num_layers) if not adapter.is_global(layer)]
    if not sliding:
        return ""
    global_ = [layer for layer in range(adapter.num_layers) if adapter.is_global(layer)]
    windows = [adapter.sliding_window(layer) for layer in sliding]
    whole = ", all of them so far" if 0 < used <= min(windows) else ""
    said = f" · {len(sliding)} of {adapter.num_layers} layers read only the last {windows_text(windows)} tokens " \
           f"(a sliding window{whole})"
    if not global_:
        return said
    others = f"the other {len(global_)} (global: {layer_ranges(global_)})"
    selecting = [layer for layer in global_ if engine.policy.is_sparse(layer)]
    config = engine.config
    budget = max((engine.policy.budget_for(layer, used) for layer in selecting), default=used)  # the widest layer's
    if not used:
        return said + f"; {others} read every token"
    if not selecting or (config.dense_under_budget and config.budget_tokens_for(used) >= used):
        return said + f"; {others} read all {used:,}"
    name = "InfiniGen" if config.policy == "infinigen" else config.policy
    fetches = f"{name} fetches up to {budget:,} of the {used:,}"
    if len(selecting) == len(global_):
        return said + f"; {fetches} on {others}"
    return said + f"; {others} read all {used:,}, but on {layer_ranges(selecting)} {fetches}"


def card_line(document: Document, record: dict, fitted: Document, window: int) -> str:
    """An attachment's card before sending: its size, and what of it this question would read when it does not
    fit whole (`fitted`: the document as the message would read it)."""
    card = f"📄 **{record['name']}** · {document.extent()} · "
    if document.read is not None:  # attached again from a stored message: the passages read then
        return card + f"read: {document.read.split(': ', 1)[-1]} · {record['tokens']:,} tokens"
    if fitted.read is None:
        return card + f"{record['tokens']:,} tokens"
    # room 0: it was not read whole because it does not fit
    note = window_note(int(record["tokens"]), room=0, window=window)
    return card + f"{note} (for this question: {fitted.read.split(': ', 1)[-1]})"


def holds_file(messages) -> bool:
    """Whether the messages hold an attached file's text (not only a reference to one above)."""
    return any(not is_read_above(record) for message in messages for record in message.attachments)


def tokens_read_note(chat) -> str:
    """After a turn in a chat that holds a file: how much of its prompt the model read, and where the rest
    came from (this chat's earlier turns, the file's text included, or the stored KV of an earlier chat
    about the same file), so a follow-up shows that the file was not read again."""
    reply = chat.messages[-1] if chat is not None and chat.messages else None
    if chat is None or reply is None or reply.role != "assistant":
        return ""
    prompt, read = reply.token_start, chat.last_read_tokens
    if read >= prompt:
        return f"Read all {prompt:,} tokens of this prompt once; a new chat about the same file starts from " \
               f"its stored KV."
    earlier = chat.messages[:-2]  # this chat's turns before this one: their KV is held, not read again
    if earlier:
        held = "this chat's earlier turns, their file included" if holds_file(earlier) else "this chat's earlier turns"
        return f"Read {read:,} new tokens; the other {prompt - read:,} of this {prompt:,}-token prompt " \
               f"({held}) were not read again: their KV is held."
    return f"Read {read:,} new tokens; the other {prompt - read:,} of this {prompt:,}-token prompt came " \
           f"from the stored KV of an earlier chat about the same file."
