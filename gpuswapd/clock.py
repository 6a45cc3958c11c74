"""The one clock of gpuswapd: every read of the time goes through here.

Durations survive the clock (gpuswapd(8), "Time"). Every deadline and duration (lease expiry,
linger, grace, park keep, the reconcile, the backoffs) is measured on ``CLOCK_BOOTTIME``: it never
steps with the wall clock (NTP, an operator's ``date -s``), and it counts the time the machine was
suspended, so a lease shorter than a suspend has ended when the machine wakes.

- ``monotonic()`` is that clock: seconds since boot, suspend included.
- ``now()`` is the daemon's time: the wall clock read once at start (``anchor``), moved on by
  ``monotonic()`` since. Leases, windows and their timings are stamped with it: a wall step moves
  none of them.
- ``wall()`` is for what a person or another process reads: the log's and events' timestamps and
  the wire's ``expires_at`` (``to_wall``: the wall-clock moment a daemon time falls on, as the wall
  clock reads now; ``from_wall`` back).
- The state document keeps the daemon's own time (``document_frame``) and a ``sample`` of it
  beside ``CLOCK_BOOTTIME`` and the boot's id: the next start in the same boot continues that time
  (``continue_from``), so a lease keeps its length across a restart and a wall step together.

In service these read ``time.time`` and ``CLOCK_BOOTTIME``. The deterministic simulation points
them at its virtual clocks (``use``), so a history of hours runs in milliseconds and replays
exactly; asyncio's own sleeps and timeouts follow the event loop's ``time()`` (``CLOCK_MONOTONIC``
in service, which stops while suspended: ``tasks.nap`` bounds every long sleep and wakes it on
resume, and the sleeper checks its deadline on this clock again).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_boot_id_read: list[str] = []  # read once: a process never outlives its boot


def _read_boot_id() -> str:
    if not _boot_id_read:
        try:
            with open(BOOT_ID) as f:
                _boot_id_read.append(f.read().strip())
        except OSError:
            _boot_id_read.append("")  # unknown: a start never continues an earlier daemon's time
    return _boot_id_read[0]


_wall: Callable[[], float] = time.time
_boot: Callable[[], float] = _boottime
_boot_id: Callable[[], str] = _read_boot_id
_kernel: Callable[[], float] = time.monotonic  # CLOCK_MONOTONIC: systemd's *TimestampMonotonic
_document: contextvars.ContextVar[bool] = contextvars.ContextVar("clock_document", default=False)
STEP_S = 0.5  # the wall clock moved this far from the daemon's time: the wire's times follow it
_anchor: tuple[float, float] = (time.time(), _boottime())  # (wall, boot) when the daemon's time was set
_offset = 0.0  # the wall clock's lead over the daemon's time, as last seen (offset())


def wall() -> float:
    """Return the wall-clock time in seconds since the epoch (timestamps a person reads)."""
    return _wall()


def monotonic() -> float:
    """Return seconds on ``CLOCK_BOOTTIME`` (every deadline and duration; the time suspended counts)."""
    return _boot()


def kernel_monotonic() -> float:
    """Return seconds on ``CLOCK_MONOTONIC``: the clock of systemd's ``*TimestampMonotonic`` properties."""
    return _kernel()


def now() -> float:
    """Return the daemon's time: the wall clock at ``anchor``, moved on by ``monotonic()`` since."""
    return _anchor[0] + (_boot() - _anchor[1])


def anchor() -> None:
    """Set the daemon's time to the wall clock (at start: the state document's times are wall-clock times)."""
    global _anchor, _offset
    _anchor, _offset = (_wall(), _boot()), 0.0


def offset() -> float:
    """Return how far the wall clock is ahead of the daemon's time: 0 until it is stepped (or slewed ``STEP_S``)."""
    global _offset
    measured = _wall() - now()
    if abs(measured - _offset) >= STEP_S:  # two reads of two clocks differ by microseconds: not a step
        _offset = measured
    return _offset


def to_wall(when: float) -> float:
    """Return the wall-clock time at which a daemon time falls, as the wall clock reads now."""
    return when if _document.get() else when + offset()


def from_wall(when: float) -> float:
    """Return the daemon time at which a wall-clock time falls, as the wall clock reads now."""
    return when if _document.get() else when - offset()


@contextlib.contextmanager
def document_frame() -> Iterator[None]:
    """Within, ``to_wall`` and ``from_wall`` keep the daemon's time: what the state document stores."""
    token = _document.set(True)
    try:
        yield
    finally:
        _document.reset(token)


def sample() -> dict[str, Any]:
    """Return the daemon's time beside ``CLOCK_BOOTTIME`` and the boot's id (stored with the state document)."""
    return {"boot_id": _boot_id(), "now": round(now(), 6), "boot": round(_boot(), 6)}


def continue_from(stored: object) -> bool:
    """Continue the daemon's time of the gpuswapd that wrote ``stored`` (a ``sample``) if it ran in this boot.

    Its times (leases, the parked engine's keep, the queue's waits) then mean what they meant to
    it, whatever the wall clock did meanwhile. Another boot, or no sample: the time stays anchored
    at the wall clock (the only clock two boots share). Return whether it continued.
    """
    global _anchor, _offset
    if not isinstance(stored, dict):
        return False
    boot_id, then, boot = stored.get("boot_id"), _finite(stored.get("now")), _finite(stored.get("boot"))
    if not isinstance(boot_id, str) or not boot_id or boot_id != _boot_id():
        return False
    if then is None or boot is None or boot > _boot():  # later than now: not this boot's after all
        return False
    _anchor = (then, boot)
    _offset = 0.0
    offset()
    return True


def stamp(when: float | None = None, fmt: str = "%Y%m%d-%H%M%S") -> str:
    """Format a wall-clock time (now by default) in local time."""
    return time.strftime(fmt, time.localtime(wall() if when is None else when))


def _finite(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def use(wall_clock: Callable[[], float], monotonic_clock: Callable[[], float],
        boot_id: Callable[[], str] = lambda: "simulated", kernel_clock: Callable[[], float] | None = None) -> None:
    """Read the time from these clocks from now on (the simulation's virtual time), anchored afresh.

    ``monotonic_clock`` stands for CLOCK_BOOTTIME, ``kernel_clock`` (by default the same) for
    CLOCK_MONOTONIC, which stops while the machine is suspended.
    """
    global _wall, _boot, _boot_id, _kernel
    _wall, _boot, _boot_id = wall_clock, monotonic_clock, boot_id
    _kernel = monotonic_clock if kernel_clock is None else kernel_clock
    anchor()


def reset() -> None:
    """Read the real clocks again."""
    use(time.time, _boottime, _read_boot_id)
    global _kernel
    _kernel = time.monotonic
