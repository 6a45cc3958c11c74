"""What the window's steps may touch: the services, read-only, and the window's state.

The steps (opening, holding, closing, parking, preempting, recovery, identity, prefetch,
progress) are handed a ``Context``, never the ``Window`` itself: they sit below it and cannot
import it, not even for a type. ``Window`` is the one implementation (structurally: mypy checks
it wherever it hands itself to a step). The driver, the Window's own supervision of the window
record, sits on top and calls the steps; a step hands the record back to it through the four
calls at the end (``finish``, ``switch``, ``recover``, ``restore_baseline``), never by reaching
into it.

- ``Services``: what a step uses and never replaces (read-only properties): the configuration,
  the parts (the resident, the engines, the VRAM, the resident's files), the outside lanes, the
  store and its writer, the queue, the backoffs, and the events that say gpuswapd is stopping.
- ``Context``: the services, plus the window's mutable state (the record, the parked engine,
  what is known of the resident, the units held down, the tasks a step starts) and what a step
  may tell (persist, enter a phase, tell holders and waiters).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from gpuswapd.config import Config, Profile
from gpuswapd.errors import GpuswapError
from gpuswapd.leases import Lease
from gpuswapd.outside import Outside
from gpuswapd.parts.engine import ContainerEngine, Engine
from gpuswapd.parts.resident import Resident
from gpuswapd.parts.vram import Vram
from gpuswapd.phases import Phase
from gpuswapd.protocol import JsonObject
from gpuswapd.record import BaselineRestore, Parked, WindowRecord
from gpuswapd.state.store import StateStore
from gpuswapd.state.writer import StateWriter
from gpuswapd.window.baseline import Known
from gpuswapd.window.price import Times
from gpuswapd.window.queueing import Queue, Waiter


@dataclass(frozen=True)
class Backoffs:
    """How the window waits between retries (first, cap), in seconds; tests shorten them."""

    restore: tuple[float, float] = (1.0, 60.0)      # starting the resident again, in DEGRADED
    take_down: tuple[float, float] = (0.5, 10.0)    # removing the engine at close
    take_down_for: float = 30.0                     # ... before the restore goes on without it
    driver: tuple[float, float] = (1.0, 60.0)       # after the driver itself failed
    writer: tuple[float, float] = (0.2, 30.0)       # writing the state document
    preempt_stop: tuple[float, float] = (1.0, 30.0)  # stopping a preempted lease's unit again


class Prefetch(Protocol):
    """The resident's model files, read into the page cache during a close (``prefetch.ResidentFiles``)."""

    def start(self, w: Context, rec: WindowRecord) -> asyncio.Task[None] | None:
        """Start reading them for this close, or None when it reads nothing."""
        ...


class Services(Protocol):
    """What a step uses and never replaces."""

    @property
    def config(self) -> Config:
        """The configuration in force."""
        ...

    @property
    def resident(self) -> Resident:
        """The resident's units, timers and verify."""
        ...

    @property
    def vram(self) -> Vram:
        """The card's free memory and who holds it."""
        ...

    @property
    def files(self) -> Prefetch:
        """The resident's model files."""
        ...

    @property
    def outside(self) -> Outside:
        """The lanes to systemd, Docker and the rest, with their hung calls."""
        ...

    @property
    def store(self) -> StateStore:
        """The state directory."""
        ...

    @property
    def writer(self) -> StateWriter:
        """The state document's writer."""
        ...

    @property
    def queue(self) -> Queue:
        """The requests waiting for a window of another profile."""
        ...

    @property
    def times(self) -> Times:
        """What opens and restores took, from history."""
        ...

    @property
    def backoffs(self) -> Backoffs:
        """The waits between retries."""
        ...

    @property
    def stopping(self) -> asyncio.Event:
        """Set: no new windows, leases or waiters (a close under way goes on)."""
        ...

    @property
    def abort(self) -> asyncio.Event:
        """Set: give up now; a close under way stops at its next wait and its record stays."""
        ...

    @property
    def wake(self) -> asyncio.Event:
        """Set to wake the holding loop (a lease changed, a request came)."""
        ...

    @property
    def closed_windows(self) -> set[str]:
        """The ids history shows closed."""
        ...

    @property
    def profile(self) -> Profile:
        """The profile of the window open now."""
        ...

    @property
    def engine(self) -> Engine:
        """The engine of the window open now."""
        ...

    @property
    def container_engine(self) -> ContainerEngine:
        """The container of the engine window open now (a bare window has none: its steps check the kind first)."""
        ...

    @property
    def phase(self) -> Phase:
        """The phase of the window open now (IDLE when none is)."""
        ...

    @property
    def resident_needs(self) -> int:
        """The VRAM the resident needs free."""
        ...

    def engine_of(self, profile: str) -> Engine:
        """Return the engine of a profile."""
        ...

    def engines_kept(self) -> set[str]:
        """Name the windows whose containers are still wanted."""
        ...


class Context(Services, Protocol):
    """The services, the window's state a step may change, and what a step may tell."""

    record: WindowRecord | None
    parked: Parked | None
    known: Known
    held_down: dict[str, float]
    went_down: dict[str, float]  # resident unit (or dependent): CLOCK_MONOTONIC of its last signal saying it went down
    park_watch: asyncio.Task[None] | None
    sweeper: asyncio.Task[None] | None
    hung_mark: tuple[int, int, int, int]
    unknown_baseline: WindowRecord | None
    stopped_unread: bool
    adopting: WindowRecord | None  # a window left by the last gpuswapd, until it is adopted or closed
    baseline_restore: BaselineRestore | None

    async def persist(self, required: bool) -> None:
        """Write the state document now (``required``: a failure raises)."""
        ...

    async def enter(self, rec: WindowRecord, phase: Phase, required: bool, overlap: bool = False) -> None:
        """Enter a phase, recorded before anything of it is done."""
        ...

    def notify_status(self) -> None:
        """Tell systemd where the window stands."""
        ...

    def tell_holders(self, event: JsonObject, leases: list[Lease] | None = None) -> None:
        """Send an event to the held connections of these leases."""
        ...

    def end_watchers(self, reason: str) -> None:
        """Tell the held connections of leases that have ended why."""
        ...

    async def grant_adopted(self, rec: WindowRecord) -> None:
        """Give the requests that queued for this profile while the window was being adopted their leases."""
        ...

    async def ready(self, rec: WindowRecord) -> None:
        """Grant the leases that wait for the window, now READY."""
        ...

    def refuse(self, waiter: Waiter, err: GpuswapError) -> None:
        """Fail one queued request."""
        ...

    def fail_waiters(self, err: GpuswapError, window: str | None = None) -> None:
        """Fail the acquires that joined ``window`` (None: every waiting acquire)."""
        ...

    def tell_queue(self) -> None:
        """Tell every queued request where it stands now."""
        ...

    # -- handing the record back to the driver ------------------------------------------------

    def finish(self, rec: WindowRecord, outcome: str, switch_to: WindowRecord | None = None) -> None:
        """End the window."""
        ...

    def switch(self, rec: WindowRecord, profile: str, outcome: str = "closed") -> None:
        """Close ``rec`` straight into a window of ``profile``."""
        ...

    def recover(self, rec: WindowRecord) -> None:
        """Take over a window an earlier gpuswapd left."""
        ...

    def restore_baseline(self, reason: str, cause: str = "state_unreadable") -> None:
        """Restore what the configuration describes."""
        ...
