"""The one place that measures how far two token sequences agree."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens `first` and `second` share.

    >>> common_prefix_length([1, 2, 3], [1, 2, 4, 5])
    2
    """
    shared = 0
    for a, b in zip(first, second):
        if a != b:
            break
        shared += 1
    return shared
