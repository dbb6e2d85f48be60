"""Token-bucket rate limits per node identity and per client address.

Invariants: a key over its limit is refused (the caller answers 429 with the message of
`RateLimited`) without any further work being done for it; memory stays bounded (the
least recently used buckets are forgotten past `max_keys`, which only ever makes a
limit more lenient, never stricter).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimited(Exception):
    """Too many requests from one identity or address."""


class RateLimiter:
    def __init__(
        self,
        per_s: float,
        burst: int,
        what: str,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.per_s = per_s
        self.burst = float(burst)
        self.what = what
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[object, tuple[float, float]] = OrderedDict()

    def check(self, key: object, label: str = "") -> None:
        """Take one token for `key`, or raise `RateLimited`."""
        now = self.clock()
        tokens, stamp = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - stamp) * self.per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            raise RateLimited(
                f"rate limit: more than {self.per_s:g} requests/s from this {self.what}"
                f"{' ' + label if label else ''}; slow down and retry"
            )
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
