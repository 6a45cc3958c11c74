"""What gpuswapd says: the window's phase, from its events (``watch``), first read from ``status``.

The phase decides whether the resident serves (IDLE, or RESUMING_TIMERS once it is verified). A
drain is seen before its ``phase_entered`` can arrive here: gpuswapd asks the gateway how many
resident requests are in flight (``[resident.idle] kind = "gateway"``) with ``?draining=1``, and
from that moment new resident requests wait, until the events say where the window went.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from gpuswapd import clock
from gpuswapd.errors import GpuswapError
from gpuswapd.logs import log
from gpuswapd.retry import backoff

RESIDENT_SERVES = frozenset({"IDLE", "RESUMING_TIMERS"})
RECONNECT_S = (0.2, 5.0)
DRAIN_MARK_S = 30.0  # a drain mark with no event since: ask status, the events may have been lost

Listener = Callable[[dict[str, Any]], None]


class Daemon(Protocol):
    """The part of gpuswapd's socket the follower uses (``link.Link``, or a fake)."""

    def watch(self) -> AsyncIterator[dict[str, Any]]:
        """Yield gpuswapd's events."""
        ...

    async def request(self, message: dict[str, Any], timeout: float = ...) -> dict[str, Any]:
        """Send one request and return its reply."""
        ...


class Follow:
    """Follows gpuswapd's window; wakes whoever waits for it to change."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.phase: str | None = None  # None: gpuswapd was never reached
        self.reachable = False
        self.listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._drain_mark: float | None = None
        self.resident_down = False  # the resident refused a connection: nothing goes to it until it answers

    def changed(self) -> asyncio.Event:
        """Return the event set at the next change (take it before looking at the state)."""
        return self._changed

    def poke(self) -> None:
        """Wake whoever waits for a change (something of the gateway's own changed)."""
        self._pulse()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def resident_serves(self) -> bool:
        """Tell whether resident requests may go to the resident now."""
        if self.resident_down:
            return False
        if self._drain_mark is not None:
            if clock.monotonic() - self._drain_mark < DRAIN_MARK_S:
                return False
            self._drain_mark = None
        return self.phase is None or self.phase in RESIDENT_SERVES

    def mark_resident(self, down: bool) -> None:
        """Hold resident requests while the resident refuses connections; let them go once it answers."""
        if down != self.resident_down:
            log.info("gateway_resident_down" if down else "gateway_resident_back", phase=self.phase)
        self.resident_down = down
        self._pulse()

    def mark_draining(self) -> None:
        """Hold new resident requests: a window drains the resident (its probe just asked)."""
        if self._drain_mark is None:
            log.info("gateway_drain_seen", phase=self.phase)
        self._drain_mark = clock.monotonic()
        self._pulse()

    def take_status(self, status: dict[str, Any]) -> None:
        """Take the phase from a ``status`` reply."""
        self.reachable = True
        self._set(str(status.get("phase") or "IDLE"))

    def take(self, event: dict[str, Any]) -> None:
        """Take one of gpuswapd's events."""
        name = event.get("event")
        if name == "phase_entered" and isinstance(event.get("phase"), str):
            self._drain_mark = None
            self._set(event["phase"])
        elif name == "window_finished":
            self._drain_mark = None
            self._set(str(event.get("phase") or "IDLE") if event.get("switched_to") else "IDLE")
        for listener in list(self.listeners):
            listener(event)

    def _set(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
        self._pulse()

    async def run(self) -> None:
        """Follow the events for as long as the gateway runs, reconnecting when gpuswapd goes away."""
        failures = 0
        while True:
            try:
                async for event in self.daemon.watch():
                    if event.get("event") == "subscribed":
                        # Subscribed first, then read: nothing that happens between is missed.
                        self.take_status(await self.daemon.request({"op": "status"}))
                        failures = 0
                        log.info("gateway_following", phase=self.phase)
                    else:
                        self.take(event)
            except GpuswapError as err:
                if self.reachable:
                    log.warning("gateway_lost_gpuswapd", error=err.message,
                                retry_in_s=backoff(RECONNECT_S, failures + 1))
                self.reachable = False
                self._pulse()
            failures += 1
            await asyncio.sleep(backoff(RECONNECT_S, failures))
