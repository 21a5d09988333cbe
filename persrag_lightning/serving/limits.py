"""Per-client rate limits of `persrag serve`: token buckets keyed by the client's address, bounded
in number."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Limits", "RateLimiter"]


@dataclass(frozen=True)
class Limits:
    """What a client address may do per minute: accounts created (sign-ups need no token, so the one
    to bound tightly; refused attempts do not count, the request limit bounds them) and requests of
    any kind. Each is a bucket of that many, refilled evenly over the minute. 0: no limit."""

    signup_per_minute: int = 10
    requests_per_minute: int = 600
    # buckets kept (least recently seen dropped first: a dropped one starts full)
    max_clients: int = 100_000


class RateLimiter:
    """Token buckets per key; `take(key)` returns 0 when a request may go, else the seconds to
    wait."""

    def __init__(
        self, per_minute: int, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic
    ):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str, spend: bool = True) -> int:
        """`spend=False`: only ask (a request that counts only once it succeeded spends later with
        `take`)."""
        if self.capacity <= 0:
            return 0
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.pop(key, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            wait = 0 if tokens >= 1 else max(1, math.ceil((1 - tokens) / self.rate))
            self._buckets[key] = (tokens - 1 if spend and not wait else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait
