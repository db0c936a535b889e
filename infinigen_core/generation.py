"""Turning logits into a streamed reply: sampling, stop conditions, cancellation.

>>> ids = chat_token_ids(engine.tokenizer, [{"role": "user", "content": "Hi"}])   # doctest: +SKIP
>>> for event in generate(engine, ids, SamplingConfig(max_new_tokens=20)):        # doctest: +SKIP
...     print(event.text, end="")

`generate` first makes the cache hold exactly `prompt_ids` (reusing the longest cached prefix, so a chat
turn only prefills its new tokens), then decodes. When it returns, every generated token, the last one
included, is in the cache, so the next turn continues from it. `cancel` is checked before every token and
between prefill chunks (`EngineConfig.prefill_chunk`), so a long prompt stops within one chunk too; the
chunks already read stay cached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .config import SamplingConfig
from .engine import InfiniGenEngine
from .stats import StepStats


@dataclass
class GenerationEvent:
    token_id: int | None
    text: str  # new text since the previous event
    full_text: str
    stats: StepStats | None
    finish_reason: str | None = None  # "eos", "stop", "length", "cancelled" or "window" on the last event


# A base model (no chat template, e.g. Gemma 3 270M's GGUF) reads the conversation as a plain transcript
# and continues it: each turn a labelled paragraph, the reply after "Assistant:".
PLAIN_ROLES = {"system": "", "user": "User: ", "assistant": "Assistant: "}
PLAIN_REPLY_PROMPT = "Assistant:"
# A base model does not end its turn, it goes on writing the next one: a new line opening with a role's label
# ends the reply ("\nUser:", "\nAssistant:"), the label itself left out of it.
PLAIN_STOP_STRINGS = tuple("\n" + label.strip() for label in PLAIN_ROLES.values() if label.strip())


def reads_plain_transcript(tokenizer) -> bool:
    """Whether the model has no chat template, so its conversation is a `plain_transcript`."""
    return tokenizer is not None and not getattr(tokenizer, "chat_template", None)


def plain_transcript(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The conversation as plain text for a model without a chat template."""
    text = "".join(PLAIN_ROLES.get(m["role"], m["role"].capitalize() + ": ") + m["content"].strip() + "\n\n"
                   for m in messages)
    return text + PLAIN_REPLY_PROMPT if add_generation_prompt else text


def chat_token_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a whole conversation in the model's chat format (a plain transcript where it has none)."""
    if reads_plain_transcript(tokenizer):
        return list(tokenizer(plain_transcript(messages, add_generation_prompt))["input_ids"])
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def chat_token_ids_many(tokenizer, conversations: list[tuple[list[dict[str, str]], bool]]) -> list[list[int]]:
    """`chat_token_ids` of several (messages, add_generation_prompt) pairs, the same ids. A plain transcript's
    texts go to the tokenizer in one batch, which a fast tokenizer encodes on all cores (a 32k-token
    conversation with and without a new message: 33 against 56 ms on two); a chat template's one by one."""
    if reads_plain_transcript(tokenizer):
        encoded = tokenizer([plain_transcript(messages, prompt) for messages, prompt in conversations])
        return [list(ids) for ids in encoded["input_ids"]]
    return [chat_token_ids(tokenizer, messages, prompt) for messages, prompt in conversations]


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, previous: list[int], generator: torch.Generator | None) -> int:
    logits = logits.float().clone()
    if sampling.repetition_penalty != 1.0 and previous:
        seen = torch.tensor(sorted(set(previous)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty)
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= sampling.top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def end_token_ids(tokenizer, generation_config=None) -> set[int]:
    """The ids that end a reply, all read from the model: its generation config's `eos_token_id` (one id or
    a list: Llama 3 lists <|eot_id|> and <|eom_id|> beside <|end_of_text|>), the tokenizer's eos, and the
    marker its chat template writes after an assistant turn (Gemma's <end_of_turn>, Phi's <|end|>), which
    a base tokenizer's eos often is not."""
    ids: set[int] = set()
    configured = getattr(generation_config, "eos_token_id", None)
    for token_id in configured if isinstance(configured, (list, tuple)) else [configured]:
        if isinstance(token_id, int) and token_id >= 0:
            ids.add(token_id)
    if tokenizer is None:
        return ids
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    turn_end = _turn_end_token_id(tokenizer)
    if turn_end is not None:
        ids.add(turn_end)
    return ids


_REPLY_SENTINEL = "Reply7q sentinel"


def _turn_end_token_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message's text, if any."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _REPLY_SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template may refuse this shape (e.g. it insists on a system turn): no marker then
        return None
    at = text.rfind(_REPLY_SENTINEL) if isinstance(text, str) else -1
    if at < 0:
        return None
    after = text[at + len(_REPLY_SENTINEL):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    if not ids:
        return None
    token = tokenizer.convert_ids_to_tokens(ids[0])
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    return ids[0] if token in specials else None  # plain text after the reply (a newline) ends nothing


class _PrefillCancelled(Exception):
    """Raised between prefill chunks when the reply was cancelled before its first token."""


def _cancellable(progress: Callable[[int, int], None] | None, cancel: threading.Event | None):
    """A prefill progress callback that also stops the prefill at the next chunk once `cancel` is set."""
    if cancel is None:
        return progress

    def report(done: int, total: int) -> None:
        if progress is not None:
            progress(done, total)
        if cancel.is_set() and done < total:
            raise _PrefillCancelled

    return report


def generate(
    engine: InfiniGenEngine,
    prompt_ids: list[int],
    sampling: SamplingConfig = SamplingConfig(),
    cancel: threading.Event | None = None,
    on_prefill_progress: Callable[[int, int], None] | None = None,
) -> Iterator[GenerationEvent]:
    tokenizer = engine.tokenizer
    end_ids = end_token_ids(tokenizer, getattr(engine.model, "generation_config", None))
    stop_strings = sampling.stop_strings + (PLAIN_STOP_STRINGS if reads_plain_transcript(tokenizer) else ())
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    if prompt_ids[-1:] and engine.token_ids == list(prompt_ids):
        # everything is cached, but the logits after the last token are needed: run it again
        engine.truncate(len(prompt_ids) - 1)
    try:
        logits = engine.sync_to(list(prompt_ids), _cancellable(on_prefill_progress, cancel))
    except _PrefillCancelled:  # the cache keeps the chunks read so far: a prefix the next turn reuses
        yield GenerationEvent(None, "", "", engine.history[-1] if engine.history else None, finish_reason="cancelled")
        return
    engine.prepare(sampling.max_new_tokens + 1)  # room for the whole reply now, not in the middle of a token
    generated: list[int] = []
    text = ""  # the reply so far, cut at a stop string
    shown = ""  # what the events have handed out: less the end of `text` that may begin a stop string
    finish = "length"
    for _ in range(sampling.max_new_tokens):
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        token = sample_next(logits, sampling, list(prompt_ids[-256:]) + generated, generator)
        generated.append(token)
        if token in end_ids:
            finish = "eos"
            break
        new_text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
        if new_text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            new_text = text
        stop_at = _first_stop(new_text, stop_strings)
        if stop_at is not None:
            new_text, finish = new_text[:stop_at], "stop"
        text = new_text
        visible = text if finish == "stop" else text[: len(text) - _stop_prefix_length(text, stop_strings)]
        delta, shown = visible[len(shown):], visible
        stats = engine.history[-1] if engine.history else None
        yield GenerationEvent(token, delta, shown, stats)
        if finish == "stop" or len(generated) == sampling.max_new_tokens:
            break
        if engine.num_tokens + 1 >= engine.max_context:
            finish = "window"  # the model's window is full: stop cleanly rather than fail mid-reply
            break
        logits = engine.decode(token)
    if generated and len(engine.token_ids) < len(prompt_ids) + len(generated) and engine.num_tokens < engine.max_context:
        engine.decode(generated[-1])  # keep the cache complete for the next turn
    stats = engine.history[-1] if engine.history else None
    yield GenerationEvent(None, text[len(shown):], text, stats, finish_reason=finish)


def _stop_prefix_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string: held back until the
    next tokens tell, so a streamed reply never shows a stop string's first half."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    hits = [text.find(stop) for stop in stop_strings if stop and stop in text]
    return min(hits) if hits else None
