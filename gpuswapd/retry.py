"""Retrying: the exponential backoff every retry in gpuswapd waits, and the retry-until-done loop.

The wait before retry ``attempt`` (1, 2, ...) doubles from the first, up to the cap: with
bounds (1, 60), 1 s, 2 s, 4 s, ... 32 s, 60 s, 60 s. A loop that counts its failures since the
last success passes that count; one that is told to start over sets it back to 0.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gpuswapd.errors import GpuswapError

T = TypeVar("T")

Bounds = tuple[float, float]  # (first, cap), in seconds


def backoff(bounds: Bounds, attempt: int) -> float:
    """Return the wait before retry ``attempt`` (1, 2, ...): doubling from the first, up to the cap.

    The cap is applied before the exponent: a loop that fails for ever counts its attempts into
    the thousands, and ``2 ** 1024`` is past any float.
    """
    first, cap = bounds
    if first <= 0:
        return float(min(cap, 0.0))
    if first >= cap:
        return float(cap)
    doublings = max(0, attempt - 1)
    if cap < math.inf:
        doublings = min(doublings, math.ceil(math.log2(cap / first)) + 1)  # enough to reach the cap
    try:
        return float(min(cap, math.ldexp(first, min(doublings, 2048))))
    except OverflowError:  # no cap, and a wait past any float
        return float(cap)


async def until_done(step: Callable[[], Awaitable[T]], bounds: Bounds,
                     failed: Callable[[GpuswapError, float], object],
                     wait: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """Run ``step`` until it returns; after each GpuswapError, tell ``failed`` and ``wait`` the backoff.

    ``failed(err, delay)`` logs (and records) the failure; ``wait`` may raise to give up (a stop).
    Any other exception ends the loop, as it would end the step.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await step()
        except GpuswapError as err:
            delay = backoff(bounds, attempt)
            failed(err, delay)
            await wait(delay)
