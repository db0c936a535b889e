"""The disk budget: keep all sessions' KV chunks under a limit by dropping the least recently used.

    dropped = enforce_disk_limit(store)     # ids of sessions whose chunks went

Only chunk files go: every message stays, and reopening such a session re-reads its text (with progress)
and writes its chunks again. A session that is open anywhere (its lock is held, by this process or
another) is skipped, so a running conversation never loses a chunk it needs; if the open sessions alone
exceed the limit, they stay over it.
"""

from __future__ import annotations

from .lock import session_lock


def enforce_disk_limit(store) -> list[str]:
    used = store.kv_bytes()
    limit = store.storage.limit_bytes(store.data_dir, used)
    if used <= limit:
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
    return dropped
