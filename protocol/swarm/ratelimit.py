"""A token bucket for trio: the node's upload or download link.

Invariants: over any window of t seconds at most `rate * t + burst` bytes pass; waiters are
served in arrival order (a lock), so one connection cannot starve the others; rate 0 means
unlimited and never sleeps.
"""

from __future__ import annotations

import trio


class TokenBucket:
    def __init__(self, rate: float, burst: float | None = None):
        self.rate = rate
        self.burst = burst if burst is not None else max(rate / 8, 64 * 1024)
        self.tokens = self.burst
        self.stamp = trio.current_time() if rate else 0.0
        self._lock = trio.Lock()
        self.total = 0  # bytes that went through

    async def take(self, n: int) -> None:
        self.total += n
        if not self.rate:
            return
        async with self._lock:
            now = trio.current_time()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            if self.tokens < 0:
                await trio.sleep(-self.tokens / self.rate)
