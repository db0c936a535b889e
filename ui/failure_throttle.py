"""Failed attempts per client address, for the two places a client can guess the app's key: the page's /login
(`site_checks.LoginThrottle`) and the API's bearer key (PageGuard).

After `attempts` failures from one address within any `window_s` seconds, that address waits until its oldest
failure leaves the window (each failure counts for `window_s` seconds, so a client that stops guessing is let
in again by itself). What waits is every attempt from the address, the right key's too: were the right key let
through, a throttled client would go on guessing at full speed and know the key by the one answer that is not
a refusal. Successes are never counted, so a client that sends the right key is never slowed by its own
requests, only while its address guesses.

    throttle = FailureThrottle(attempts=10, window_s=60)
    wait = throttle.wait_for("10.0.0.1")      # None, or the seconds to wait (the answer's Retry-After)
    throttle.note_failure("10.0.0.1")        # after a wrong key
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

# tracked addresses past which those with no failure in the window are forgotten (a client cycling addresses
# cannot grow the table for ever)
MAX_TRACKED_ADDRESSES = 10_000


@dataclass
class FailureThrottle:
    attempts: int = 10
    window_s: float = 60.0
    _failures: dict[str, deque] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait_for(self, address: str, now: float | None = None) -> int | None:
        """None when `address` may try; else the whole seconds until it may try again (1 at least)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            recent = self._failures.get(address, deque())
            while recent and now - recent[0] >= self.window_s:
                recent.popleft()
            if len(recent) >= self.attempts:
                return max(1, int(self.window_s - (now - recent[0]) + 0.999))
        return None

    def note_failure(self, address: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if len(self._failures) > MAX_TRACKED_ADDRESSES:
                self._failures = {a: f for a, f in self._failures.items() if f and now - f[-1] < self.window_s}
            self._failures.setdefault(address, deque()).append(now)
