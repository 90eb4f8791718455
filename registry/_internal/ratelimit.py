"""Per-token rate limiting: one token bucket per token id.

Each token may make ``burst`` requests at once and then ``rate`` requests per second on
average; a request past that is refused with ``429 rate-limited`` and a ``Retry-After`` that
says when the next one will be accepted. Buckets are keyed by the token's *id*, never by the
token itself, so no secret is held here. Anonymous reads are not limited by this (there is no
token to key them by); put a reverse proxy in front for per-address limits.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import RateLimitedError

#: Buckets not touched for this long are full again and are dropped, so memory stays bounded
#: by the number of tokens active recently, not by every token ever seen.
_IDLE_DROP_SECONDS = 600.0


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """Token buckets keyed by token id; thread-safe (handlers call it from worker threads).

    ``rate`` is requests per second refilled, ``burst`` the bucket's size. ``rate`` 0 turns
    limiting off. ``clock`` is injectable so that tests need not sleep.
    """

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"rate must be a finite number >= 0, got {rate!r}")
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError(f"burst must be a positive int, got {burst!r}")
        self.rate = float(rate)
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        self._last_sweep = clock()

    @property
    def enabled(self) -> bool:
        """Whether requests are limited at all."""
        return self.rate > 0

    def acquire(self, token_id: str) -> None:
        """Take one request from ``token_id``'s bucket; ``RateLimitedError`` (429) when it is empty."""
        if not self.enabled:
            return
        with self._lock:
            now = self._clock()
            self._sweep(now)
            bucket = self._buckets.get(token_id)
            if bucket is None:
                bucket = self._buckets[token_id] = _Bucket(tokens=float(self.burst), updated=now)
            else:
                bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.updated) * self.rate)
                bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return
            wait = (1.0 - bucket.tokens) / self.rate
        # Retry-After is whole seconds (RFC 9110 section 10.2.3); round up so a client that
        # waits exactly that long is accepted.
        retry_after = max(1, math.ceil(wait))
        raise RateLimitedError(
            f"token {token_id} made more than {self.burst} requests at once or more than {self.rate:g} per second",
            retry_after=retry_after,
        )

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < _IDLE_DROP_SECONDS:
            return
        self._last_sweep = now
        stale = [k for k, b in self._buckets.items() if now - b.updated >= _IDLE_DROP_SECONDS]
        for k in stale:
            del self._buckets[k]
