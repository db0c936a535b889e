"""How fast the saved chats are searched, and what the index costs on disk.

    python -m bench search [--sessions 2000] [--messages 50] [--queries 200]

Fills an empty session database through `SessionStore` (so the triggers build the index as the app's writes
do) with `--sessions` chats of `--messages` messages, then times `store.search` for a mix of queries and
reports the median and 90th percentile, and the share of the database file the index's tables take
(SQLite's dbstat, after a checkpoint). Targets from issue 32: a median of at most 50 ms and at most 30% of
the database.

Message text follows Zipf's law over a vocabulary of 20,000 words whose most frequent ones are the words of
bench/data/cat_and_racket.txt in their order of frequency (the rest are made-up words), a user message about
20 words and a reply about 90, so queries meet a realistic spread: words in nearly every message, words in a
few hundred, words in a handful. Queries: a rare word, a mid-frequency word, a common word, two words, and
the first three letters of a word (the box searches as one types).
"""

from __future__ import annotations

import itertools
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "cat_and_racket.txt"
VOCABULARY = 20_000
USER_WORDS, REPLY_WORDS = 20, 90
QUERY_KINDS = ("rare word", "mid word", "common word", "two words", "prefix")


def vocabulary(size: int = VOCABULARY, seed: int = 0) -> list[str]:
    """English words by frequency first, then made-up ones (syllables) up to `size`."""
    counts = Counter(re.findall(r"[a-z]+", DATA.read_text(encoding="utf-8").lower()))
    words = [word for word, _ in counts.most_common()]
    known, rng = set(words), random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    while len(words) < size:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))
        if word not in known:
            known.add(word)
            words.append(word)
    return words


class ZipfText:
    def __init__(self, words: list[str], seed: int = 1) -> None:
        self.words, self.rng = words, random.Random(seed)
        self.cumulative = list(itertools.accumulate(1 / rank for rank in range(1, len(words) + 1)))

    def message(self, length: int) -> str:
        count = max(3, int(self.rng.gauss(length, length / 3)))
        chosen = self.rng.choices(self.words, cum_weights=self.cumulative, k=count)
        return " ".join(chosen).capitalize() + "."


def fill(store, sessions: int, messages: int, show=lambda line: None) -> None:
    text = ZipfText(vocabulary())
    for n in range(sessions):
        session_id = store.create(f"Chat {n}: " + text.message(4))
        rows = [("user", text.message(USER_WORDS), 0, 0) if k % 2 == 0 else ("assistant", text.message(REPLY_WORDS), 0, 0)
                for k in range(messages)]
        store.add_messages(session_id, rows)
        if (n + 1) % 250 == 0:
            show(f"{n + 1:,} sessions written")


def queries(count: int, seed: int = 2) -> list[tuple[str, str]]:
    """(kind, text) pairs, the kinds in turn."""
    words, rng = vocabulary(), random.Random(seed)
    pick = {"rare word": lambda: rng.choice(words[5000:]), "mid word": lambda: rng.choice(words[300:3000]),
            "common word": lambda: rng.choice(words[:50]),
            "two words": lambda: f"{rng.choice(words[50:2000])} {rng.choice(words[50:2000])}",
            "prefix": lambda: rng.choice([w for w in words[:3000] if len(w) > 4])[:3]}
    return [(kind, pick[kind]()) for kind in (QUERY_KINDS[i % len(QUERY_KINDS)] for i in range(count))]


def index_share(store) -> tuple[int, int]:
    """(bytes of the index's tables, bytes of the database file) once the WAL is checkpointed into it."""
    from sessions.search import index_table_names

    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    names = sorted(index_table_names())
    marks = ", ".join("?" * len(names))
    index_bytes = store.db.execute(f"SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name IN ({marks})",
                                   names).fetchone()[0]
    return index_bytes, (store.data_dir / "sessions.db").stat().st_size


def measure(sessions: int = 2000, messages: int = 50, query_count: int = 200, show=lambda line: None) -> dict:
    from sessions import SessionStore

    with tempfile.TemporaryDirectory(prefix="search-bench-") as folder:
        store = SessionStore(folder)
        store.db.execute("PRAGMA synchronous=OFF")  # the fill is set-up, not measured: no fsync per session
        started = time.perf_counter()
        fill(store, sessions, messages, show)
        fill_s = time.perf_counter() - started
        index_bytes, db_bytes = index_share(store)
        times: dict[str, list[float]] = {kind: [] for kind in QUERY_KINDS}
        hits = []
        for kind, text in queries(query_count):
            started = time.perf_counter()
            found = store.search(text)
            times[kind].append((time.perf_counter() - started) * 1000)
            hits.append(len(found))
        store.db.conn.close()
    every = [t for kind in QUERY_KINDS for t in times[kind]]
    return {"sessions": sessions, "messages_per_session": messages, "queries": query_count,
            "median_ms": statistics.median(every), "p90_ms": statistics.quantiles(every, n=10)[-1],
            "max_ms": max(every), **{f"median_ms_{kind.replace(' ', '_')}": statistics.median(times[kind])
                                     for kind in QUERY_KINDS},
            "median_hits": statistics.median(hits), "db_mb": db_bytes / 2**20, "index_mb": index_bytes / 2**20,
            "index_share": index_bytes / db_bytes, "fill_s": fill_s}
