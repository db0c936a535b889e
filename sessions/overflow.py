"""When a chat outgrows the model's window: which whole turns go so that the next message and a short reply fit.

    OVERFLOW_POLICIES["drop_oldest"]            # 'Drop the oldest turns' (the page's label)
    cut = turns_kept(messages, fits, keep_first=False)    # None: nothing the policy may drop makes it fit
    cut.kept, cut.dropped                                  # what stays, and the whole turns that go

A turn is a user message and what follows it up to the next user message (its reply). The system prompt is
not a message and always stays. The most recent turn stays too, so the new message still reads as an answer
to what was just said: the same rule as the "Drop oldest turns" button and the window error's "N can go".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, TypeVar

OVERFLOW_LABEL = "When the chat outgrows the window"  # the setting's name on the page
# its choices: the value stored with a session's settings, and the page's label
OVERFLOW_POLICIES = {
    "stop": "Stop and ask",
    "drop_oldest": "Drop the oldest turns",
    "keep_first": "Keep the first turn, drop the middle",
}
DEFAULT_OVERFLOW = "stop"

M = TypeVar("M")  # a stored message (sessions.store.Message): anything with a `role`


def check_overflow(policy: str) -> str:
    """`policy` as stored (a key of OVERFLOW_POLICIES; the page's label is taken too); ValueError otherwise."""
    text = str(policy or "").strip()
    for key, label in OVERFLOW_POLICIES.items():
        if text in (key, label):
            return key
    choices = ", ".join(f"{key!r} ({label})" for key, label in OVERFLOW_POLICIES.items())
    raise ValueError(f"“{OVERFLOW_LABEL}” must be one of {choices}, not {policy!r}")


class Cut(NamedTuple, Generic[M]):
    kept: list[M]  # the messages left, in order: a head (the first turn, with keep_first) and a tail
    dropped: list[M]  # the whole turns between them that go, in order


def turns_kept(messages: Sequence[M], fits: Callable[[list[M]], bool], keep_first: bool = False,
               mend: Callable[[list[M]], list[M]] | None = None) -> Cut[M] | None:
    """The fewest whole turns dropped from `messages` so that `fits(kept)`: the oldest first, or with
    `keep_first` those after the first turn. Nothing dropped when `messages` fit; None when even the
    shortest history the policy allows does not. `mend` makes what a cut keeps whole again before it is
    checked and kept (StoredConversation's: a file's text that a dropped turn held goes back into the first
    kept message that referred to it); it never adds more than the cut took away."""
    kept = list(messages)
    if fits(kept):
        return Cut(kept, [])
    starts = [index for index, message in enumerate(kept) if getattr(message, "role") == "user"]
    first = 1 if keep_first else 0  # the turns before this one never go
    head = kept[: starts[1]] if keep_first and len(starts) > 1 else []

    def candidate(cut: int) -> list[M]:  # turns [first, cut) dropped
        left = head + kept[starts[cut]:]
        return mend(left) if mend is not None else left

    # dropping more turns never adds tokens, so the fewest that fit are found by halving: log2(turns) checks.
    # lo..hi-1 are the cuts still in question (the last turn always stays); hi == len(starts): none fits yet
    lo, hi = first + 1, len(starts)
    while lo < hi:
        middle = (lo + hi) // 2
        if fits(candidate(middle)):
            hi = middle
        else:
            lo = middle + 1
    if lo >= len(starts):
        return None
    return Cut(candidate(lo), kept[len(head): starts[lo]])
