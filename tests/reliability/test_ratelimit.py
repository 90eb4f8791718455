"""The per-token rate limiter, with an injected clock (no sleeping)."""

from __future__ import annotations

import pytest

from kvgraft.registry import RegistrySettings
from kvgraft.registry._internal.errors import RateLimitedError
from kvgraft.registry._internal.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refused_with_retry_after() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    for _ in range(limiter.burst):
        limiter.acquire("tok_a")
    with pytest.raises(RateLimitedError, match="token tok_a made more than 3 requests at once") as info:
        limiter.acquire("tok_a")
    assert info.value.status_code == 429
    assert info.value.headers() == {"Retry-After": "1"}
    assert info.value.extra == {"retry_after": 1}


def test_refills_at_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=0.25, burst=1, clock=clock)
    limiter.acquire("tok_a")
    with pytest.raises(RateLimitedError) as info:
        limiter.acquire("tok_a")
    # One request per 4 s: the client is told to wait 4 s, and after that it is accepted.
    assert info.value.retry_after == 4
    clock.now += 3.9
    with pytest.raises(RateLimitedError):
        limiter.acquire("tok_a")
    clock.now += 4.0
    limiter.acquire("tok_a")


def test_buckets_are_per_token() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1.0, burst=1, clock=clock)
    limiter.acquire("tok_a")
    with pytest.raises(RateLimitedError, match="tok_a"):
        limiter.acquire("tok_a")
    limiter.acquire("tok_b")


def test_zero_rate_is_no_limit() -> None:
    limiter = RateLimiter(rate=0, burst=1, clock=Clock())
    assert not limiter.enabled
    for _ in range(1000):
        limiter.acquire("tok_a")


def test_idle_buckets_are_dropped() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1.0, burst=1, clock=clock)
    for i in range(100):
        limiter.acquire(f"tok_{i}")
    clock.now += 3600
    limiter.acquire("tok_new")
    assert set(limiter._buckets) == {"tok_new"}


@pytest.mark.parametrize(
    ("rate", "burst", "message"),
    [(-1.0, 1, "rate must be a finite number"), (float("nan"), 1, "rate must be a finite number"),
     (float("inf"), 1, "rate must be a finite number"), (1.0, 0, "burst must be a positive int"), (1.0, True, "burst must be")],
)
def test_bad_parameters(rate: float, burst: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RateLimiter(rate=rate, burst=burst)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rate_limit": -1}, "rate_limit must be a finite number"), ({"rate_limit": float("nan")}, "rate_limit"),
     ({"rate_burst": 0}, "rate_burst must be a positive int")],
)
def test_settings_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RegistrySettings(**kwargs)  # type: ignore[arg-type]
