"""An asyncio event loop that runs on virtual time: when nothing is ready, time jumps to the next timer."""

from __future__ import annotations

import asyncio
import selectors
import sys
from collections.abc import Callable
from typing import Any

EPOCH = 1_800_000_000.0  # the wall clock at virtual time 0 (January 2027)


SPIN_TURNS = 10_000  # turns of the loop at one instant: a busy loop (a history's most is under 200)
SPIN_READS = 100_000  # reads of CLOCK_BOOTTIME at one instant: a busy loop (a history's most is under 500)


class Deadlock(RuntimeError):
    """Nothing is ready and nothing is scheduled: the history can never go on."""


class Spin(BaseException):
    """The loop keeps turning, or the clock keeps being read, and time does not move on.

    Something waits for time without sleeping. On a real clock such a loop ends when the time it
    waits for comes, after burning a core (and writing a log line a turn); on this one it never
    does, and its garbage fills the memory. Not an ``Exception``: no handler of gpuswapd's takes it
    for a failure to retry.
    """


class VirtualClock:
    """Virtual seconds shared by every incarnation of the daemon and by the simulated world."""

    def __init__(self) -> None:
        self.now = 0.0  # CLOCK_MONOTONIC: the event loop's time and the world's (it stops in a suspend)
        self.wall_offset = 0.0  # what the wall clock was stepped by (an operator's date, NTP)
        self.suspended = 0.0  # how long the machine was suspended in all
        self.spun = ""  # what spun (Spin), once something has
        self._read_at, self._reads = -1.0, 0

    def monotonic(self) -> float:
        """Return the virtual CLOCK_BOOTTIME (gpuswapd's durations): it counts the time suspended."""
        if self.now != self._read_at:
            self._read_at, self._reads = self.now, 0
        self._reads += 1
        if self._reads > SPIN_READS or self.spun:
            self.spun = self.spun or (f"CLOCK_BOOTTIME read {SPIN_READS} times at virtual time {self.now:.6f}s without "
                                      f"time moving on{_reader()}: something waits for time without sleeping (a busy "
                                      "loop)")
            raise Spin(self.spun)
        return self.now + self.suspended

    def kernel(self) -> float:
        """Return the virtual CLOCK_MONOTONIC (systemd's *TimestampMonotonic): it stops in a suspend."""
        return self.now

    def wall(self) -> float:
        """Return the virtual wall-clock time (it counts the time suspended, and follows steps)."""
        return EPOCH + self.now + self.suspended + self.wall_offset


def _reader() -> str:
    """Name gpuswapd's line that reads the clock (the clock's own module left out)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/gpuswapd/" in name and not name.endswith("/gpuswapd/clock.py"):
            return f", by {name.rsplit('/gpuswapd/', 1)[1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


class _Selector(selectors.SelectSelector):
    """No file descriptor is ever ready (the simulation has none): select() only moves the clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.on_turn: Callable[[], None] | None = None  # called once per turn of the loop
        self._instant, self._turns = -1.0, 0  # the time of the last turns, and how many there were

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.clock.spun:
            raise Spin(self.clock.spun)
        if self.on_turn is not None:
            self.on_turn()
        if self.clock.now != self._instant:
            self._instant, self._turns = self.clock.now, 0
        self._turns += 1
        if self._turns > SPIN_TURNS:
            self._turns = 0
            raise Spin(f"{SPIN_TURNS} turns of the event loop at virtual time {self.clock.now:.6f}s without time "
                       "moving on: something waits for time without sleeping (a busy loop)")
        if timeout is None:
            raise Deadlock("nothing is ready and no timer is scheduled")
        if timeout > 0:
            self.clock.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """One incarnation's event loop on the shared virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.selector = _Selector(clock)
        super().__init__(self.selector)
        self.clock = clock
        self.errors: list[str] = []
        self.set_exception_handler(self._unhandled)

    def time(self) -> float:
        """Return the virtual time: asyncio's sleeps and timeouts follow it."""
        return self.clock.now

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        """Schedule ``callback`` at ``when``; time reaches ``when`` before it runs.

        asyncio runs a timer due within its clock's resolution (1 ns) at once; on a real clock the
        next look at the time is later, on this one it is not: a loop that waits out the last
        picoseconds of a deadline would spin at one instant for ever.
        """
        return super().call_at(when, self._due, when, callback, args, context=context)

    def _due(self, when: float, callback: Any, args: tuple[Any, ...]) -> None:
        if when > self.clock.now:
            self.clock.now = when
        callback(*args)

    def close(self) -> None:
        """Close it, and let go of the run its selector reports to."""
        self.selector.on_turn = None
        super().close()

    def _write_to_self(self) -> None:
        """Nothing to wake: every callback comes from this thread."""

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        self.errors.append(f"{context.get('message')}: {exc!r}" if exc is not None else str(context.get("message")))
