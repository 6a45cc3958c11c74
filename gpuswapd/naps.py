"""Sleeps that keep their meaning across a suspend.

asyncio's loop sleeps on ``CLOCK_MONOTONIC``, which stops while the machine is suspended: a
one-hour sleep begun before a ten-minute suspend would end ten minutes late. So no sleep of
gpuswapd is longer than a nap, and every sleeper checks its deadline on ``clock.monotonic()``
(``CLOCK_BOOTTIME``, which counts the suspend) when it wakes. A nap is a few seconds
(``NAP_S``) unless something tells of every resume: the daemon follows logind's
``PrepareForSleep(false)`` over D-Bus and calls ``resumed``, which wakes every nap at once; then a
nap may be longer (``TOLD_NAP_S``), a bound for a signal that went missing.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from gpuswapd import clock

NAP_S = 5.0  # nothing tells of a resume: a deadline that passed in a suspend is seen within this
TOLD_NAP_S = 60.0  # logind tells of every resume: this only bounds a lost signal

EARLY_S = 1e-3  # a sleep this close to its end is over

_longest = NAP_S
# Weak: a nap whose loop was thrown away never runs its ``finally`` (the simulation's dead
# incarnations), and must not keep that loop and everything on it alive.
_napping: weakref.WeakSet[Callable[[], None]] = weakref.WeakSet()


def resumes_told(told: bool) -> None:
    """Say whether something calls ``resumed`` at every resume (naps may be longer then)."""
    global _longest
    _longest = TOLD_NAP_S if told else NAP_S


def longest() -> float:
    """Return the longest nap now."""
    return _longest


def resumed() -> None:
    """Wake every nap: the machine has resumed from a suspend (call on the event loop)."""
    for wake in list(_napping):
        wake()


async def nap(seconds: float, *also: asyncio.Future[Any]) -> None:
    """Sleep up to ``seconds``, no longer than a nap; wake early when one of ``also`` is done or on a resume."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake(_: Any = None) -> None:
        if loop.is_closed():  # a loop thrown away with this nap in it (the simulation's dead incarnations)
            _napping.discard(wake)
        elif not woken.done():
            woken.set_result(None)

    timer = loop.call_later(max(0.0, min(seconds, _longest)), wake)
    _napping.add(wake)
    for other in also:
        other.add_done_callback(wake)
    try:
        await woken
    finally:
        timer.cancel()
        _napping.discard(wake)
        for other in also:
            other.remove_done_callback(wake)


def due(deadline: float) -> bool:
    """Tell whether ``deadline`` (on ``clock.monotonic()``) has come, as a sleep toward it tells: within ``EARLY_S``.

    A loop that pauses toward its deadline must end by this, not by ``>=``: its last pause, a
    sliver, is over at once, and it would ask again and again until the clock catches up.
    """
    return deadline - clock.monotonic() <= EARLY_S


async def sleep_until(deadline: float, event: asyncio.Event | None = None) -> bool:
    """Sleep until ``clock.monotonic()`` reaches ``deadline``, or ``event`` is set; tell whether it is."""
    setter = None if event is None or event.is_set() else asyncio.ensure_future(event.wait())
    try:
        while True:
            if event is not None and event.is_set():
                return True
            if due(deadline):  # asyncio fires a timer up to its clock's resolution early: never nap for a sliver
                return False
            left = deadline - clock.monotonic()
            await (nap(left) if setter is None else nap(left, setter))
    finally:
        # A loop thrown away with this sleep in it (the simulation's incarnations) is closed by now.
        if setter is not None and not setter.get_loop().is_closed():
            setter.cancel()


async def sleep(seconds: float) -> None:
    """Sleep ``seconds`` on ``CLOCK_BOOTTIME`` (a suspend meanwhile counts)."""
    await sleep_until(clock.monotonic() + seconds)
