"""The disk budget: keep all sessions' KV chunks under a limit by dropping the least recently used.

    dropped = enforce_disk_limit(store)     # ids of sessions whose chunks went

Only chunk files go: every message stays, and reopening such a session re-reads its text (with progress)
and writes its chunks again. A session that is open anywhere (its lock is held, by this process or
another) is skipped, so a running conversation never loses a chunk it needs; if the open sessions alone
exceed the limit, they stay over it: then `store.over_disk_limit` holds (used, limit) bytes, the log says so
once, and the page's status line says so while it lasts.
"""

from __future__ import annotations

import logging

from .lock import session_lock

log = logging.getLogger("infinigen.sessions")


def enforce_disk_limit(store) -> list[str]:
    used = store.kv_bytes()
    limit = store.storage.limit_bytes(store.data_dir, used)
    if used <= limit:
        store.over_disk_limit = None
        return []
    dropped = []
    for session_id in store.sessions_with_chunks_least_recent_first():
        if used <= limit:
            break
        lock = session_lock(store.data_dir, session_id)
        if not lock.try_acquire():
            continue
        try:
            store.drop_all_chunks(session_id)
        finally:
            lock.release()
        dropped.append(session_id)
        used = store.kv_bytes()
    _note_over_limit(store, used, limit)
    return dropped


def _note_over_limit(store, used: int, limit: int) -> None:
    over = (used, limit) if used > limit else None
    before = store.over_disk_limit
    store.over_disk_limit = over
    if over is not None and (before is None or before[1] != limit):
        from .storage import format_size

        log.warning("the sessions' KV cache on disk takes %s, over its limit of %s: the open session's chunks "
                    "are kept while it is open", format_size(used), format_size(limit))
