"""The one backoff every retry waits, and the retry-until-done loop."""

from __future__ import annotations

import asyncio
import math

import pytest

from gpuswapd.errors import GpuswapError, StateError
from gpuswapd.retry import backoff, until_done


def test_the_wait_doubles_from_the_first_up_to_the_cap() -> None:
    assert [backoff((1.0, 60.0), n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [backoff((0.05, 1.0), n) for n in range(1, 7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert backoff((0.2, 30.0), 0) == 0.2  # no failure counted yet: the first wait
    assert backoff((1.0, math.inf), 11) == 1024.0  # no cap


def test_the_wait_is_what_doubling_each_time_gives() -> None:
    """A loop that doubled its own delay (min(delay * 2, cap)) waits exactly the same."""
    for first, cap in [(0.005, 0.02), (0.2, 30.0), (0.5, 10.0), (1.0, 60.0), (0.05, 1.0)]:
        delay = first
        for attempt in range(1, 20):
            assert backoff((first, cap), attempt) == delay
            delay = min(delay * 2, cap)


def test_until_done_retries_each_failure_after_its_backoff() -> None:
    failures = [GpuswapError("one"), StateError("two"), GpuswapError("three")]
    told: list[tuple[str, float]] = []
    waited: list[float] = []

    async def step() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    async def wait(seconds: float) -> None:
        waited.append(seconds)

    result = asyncio.run(until_done(step, (1.0, 3.0), lambda err, delay: told.append((err.message, delay)), wait))
    assert result == "done"
    assert told == [("one", 1.0), ("two", 2.0), ("three", 3.0)]
    assert waited == [1.0, 2.0, 3.0]


def test_until_done_stops_on_what_is_not_a_gpuswapd_error_and_when_the_wait_gives_up() -> None:
    calls: list[int] = []

    async def broken() -> None:
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        asyncio.run(until_done(broken, (1.0, 2.0), lambda err, delay: None))
    assert calls == [1]

    async def failing() -> None:
        calls.append(2)
        raise GpuswapError("down")

    async def give_up(seconds: float) -> None:
        raise LookupError("stopping")

    with pytest.raises(LookupError):
        asyncio.run(until_done(failing, (1.0, 2.0), lambda err, delay: None, give_up))
    assert calls == [1, 2]


def test_an_attempt_counted_into_the_thousands_waits_the_cap() -> None:
    """The cap comes before the exponent: 2 ** 1024 is past any float (seeds 7342340, 7342878)."""
    assert backoff((0.2, 30.0), 1025) == 30.0
    assert backoff((0.05, 1.0), 10**6) == 1.0
    assert backoff((1.0, math.inf), 5000) == math.inf
    assert backoff((0.0, 5.0), 10**6) == 0.0
    assert backoff((10.0, 5.0), 10**6) == 5.0
