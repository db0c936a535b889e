"""The words a user searches for: as a safe FTS5 query, and as a highlighter for the text shown with a hit.

    terms = SearchTerms.parse('harbour "cat')      # words: ('harbour', 'cat'), the last one still being typed
    terms.fts_query()                              # '"harbour" "cat"*'  (no FTS5 syntax survives from the user)
    terms.snippet("The harbour master's cat")      # 'The <mark>harbour</mark> master&#x27;s <mark>cat</mark>'

Words are cut and compared as FTS5's unicode61 tokenizer (remove_diacritics 2) does: runs of letters and
digits, without case or accents, so the words marked in a snippet are the words that matched.
"""

from __future__ import annotations

import bisect
import functools
import html
import re
import unicodedata
from dataclasses import dataclass

_SPACES = re.compile(r"\s+")
_WORD = re.compile(r"[^\W_]+")  # unicode61's tokens: letters and digits; everything else separates them
MAX_QUERY_WORDS = 16
SNIPPET_WORDS = 14  # words of context shown around the first match
SNIPPET_LEAD = 4  # of which before it
_LONG_WORD = 40  # characters: a stretch of SNIPPET_WORDS x this around a match holds the snippet's words
# one- and two-letter beginnings would fetch nearly every message: only a word of this length is a prefix
MIN_PREFIX_CHARS = 2


def fold(word: str) -> str:
    """A word as the index keeps it: lower case, accents removed."""
    if word.isascii():
        return word.lower()
    decomposed = unicodedata.normalize("NFKD", word)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


@dataclass(frozen=True)
class SearchTerms:
    words: tuple[str, ...]  # as typed (FTS5 folds them itself)
    last_is_prefix: bool  # the last word is still being typed: it also matches longer words

    @classmethod
    def parse(cls, text: str) -> SearchTerms:
        """The words of `text`; its last word is a prefix unless a space ends the text or it is a single letter."""
        words = tuple(_WORD.findall(text)[:MAX_QUERY_WORDS])
        typing = bool(words) and not text[-1:].isspace() and len(words[-1]) >= MIN_PREFIX_CHARS
        return cls(words, typing)

    def fts_query(self) -> str | None:
        """Every word quoted (all must match); None when there is no word to search for."""
        if not self.words:
            return None
        terms = [f'"{word}"' for word in self.words]  # a word of letters and digits holds no quote to escape
        if self.last_is_prefix:
            terms[-1] += "*"
        return " ".join(terms)

    @functools.cached_property
    def _folded(self) -> tuple[frozenset[str], str]:
        """(every word folded, the last one folded): computed once, used for every word of every snippet."""
        folded = [fold(word) for word in self.words]
        return frozenset(folded), folded[-1] if folded else ""

    @functools.cached_property
    def _ascii_pattern(self) -> re.Pattern:
        """The matching words as one regular expression, for ASCII text (most chats), where folding is lower()."""
        whole, last = self._folded
        options = sorted(map(re.escape, whole), key=len, reverse=True)
        if self.last_is_prefix:
            options.insert(0, re.escape(last) + r"[^\W_]*")
        return re.compile(r"(?<![^\W_])(?:" + "|".join(options or ["(?!)"]) + r")(?![^\W_])", re.IGNORECASE)

    def first_match(self, text: str) -> int | None:
        """Where the first matching word of `text` starts (None: no word matches)."""
        if text.isascii():
            found = self._ascii_pattern.search(text)
            return found.start() if found else None
        return next((m.start() for m in _WORD.finditer(text) if self.matches(m.group())), None)

    def matches(self, word: str) -> bool:
        whole, last = self._folded
        folded = fold(word)
        return folded in whole or (self.last_is_prefix and folded.startswith(last))

    def highlight(self, text: str) -> str:
        """The whole `text` as HTML, the matching words in <mark>."""
        return self._marked(text, 0, len(text))

    def snippet(self, text: str) -> str:
        """HTML: about SNIPPET_WORDS words of `text` from a little before its first matching word, '…' where
        it was cut. Only the stretch around the match is read (a reply can be long)."""
        at = self.first_match(text) or 0
        region = max(0, at - SNIPPET_LEAD * _LONG_WORD)
        spans = [m.span() for m in _WORD.finditer(text, region, at + SNIPPET_WORDS * _LONG_WORD)]
        if region > 0:
            spans = spans[1:]  # it may be the end of a word cut in two
        if not spans:
            return _between(text[:80])
        first = bisect.bisect_left(spans, (at, 0))
        start = max(0, min(first - SNIPPET_LEAD, len(spans) - SNIPPET_WORDS))  # near the end: more before it
        end = min(len(spans), start + SNIPPET_WORDS)
        begin = spans[start][0] if start > 0 or region > 0 else 0
        finish = spans[end - 1][1] if _WORD.search(text, spans[end - 1][1]) else len(text)
        body = self._marked(text, begin, finish)
        return ("…" if begin > 0 else "") + body.strip() + ("…" if finish < len(text) else "")

    def _marked(self, text: str, begin: int, end: int) -> str:
        pieces, at = [], begin
        for match in _WORD.finditer(text, begin, end):
            if self.matches(match.group()):
                pieces += [_between(text[at:match.start()]),
                           f"<mark>{html.escape(match.group(), quote=False)}</mark>"]
                at = match.end()
        pieces.append(_between(text[at:end]))
        return "".join(pieces)


def _between(text: str) -> str:
    """Text between marked words, escaped, on one line (a snippet is one line of the sidebar)."""
    return html.escape(_SPACES.sub(" ", text), quote=False)
