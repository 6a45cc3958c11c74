"""Whatever watches the window from outside it: the event bus's subscribers, the metrics, STATUS= progress.

None of them holds the window up: the bus delivers on the event loop to subscribers that only
count, buffer or spawn; the textfile is written on a thread of its own; hooks run as processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from gpuswapd import __version__, clock
from gpuswapd.config import Config
from gpuswapd.events import Event, EventBus
from gpuswapd.logs import log
from gpuswapd.observe.hooks import Hooks
from gpuswapd.observe.metrics import Metrics, window_now
from gpuswapd.observe.scrape import ScrapeServer
from gpuswapd.observe.textfile import Textfile
from gpuswapd.phases import Phase
from gpuswapd.record import Finished
from gpuswapd.server.server import Server
from gpuswapd.server.watch import Watchers
from gpuswapd.tasks import reap, spawn
from gpuswapd.window.progress import TICK_S
from gpuswapd.window.window import Window


class Observers:
    """The metrics endpoints, the hooks, the watchers and the STATUS= ticker of one daemon."""

    def __init__(self, config: Config, window: Window, server: Server, bus: EventBus, instance: str) -> None:
        self.window = window
        self.bus = bus
        m, h = config.metrics, config.hooks
        self.metrics = Metrics(lambda: window_now(window), __version__, instance)
        self.textfile = Textfile(m.textfile, self.metrics.exposition) if m.textfile else None
        self.scrape = ScrapeServer(m.listen, self.metrics.exposition, server.admission) if m.listen else None
        self.hooks = Hooks(h.command, h.events, h.timeout, self.metrics.hook_event_dropped) if h.command else None
        self.watchers = server.watchers = Watchers(bus)
        window.finished.append(self._window_finished)
        self._opened = asyncio.Event()  # a phase was entered: the ticker has something to show
        self._ticker: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] = lambda: None

    async def start(self) -> None:
        """Listen for scrapes (ConfigError if the port cannot be had), then take events."""
        if self.scrape is not None:
            await self.scrape.start()
        self.bus.context = self._context
        self.bus.attach(asyncio.get_running_loop())
        self._unsubscribe = self.bus.subscribe(self._on_event)
        if self.textfile is not None:
            self.textfile.request()
        self._ticker = spawn(self._tick(), "status-ticker")

    async def close(self) -> None:
        """Stop the ticker and the hooks, write the textfile once more, stop listening."""
        self._unsubscribe()
        await reap(self._ticker)
        if self.hooks is not None:
            await self.hooks.close()
        if self.textfile is not None:
            await self.textfile.close()
        if self.scrape is not None:
            await self.scrape.close()
        self.bus.detach()

    def _context(self) -> Mapping[str, Any]:
        """Say which window an event belongs to when its logging context does not (any thread)."""
        rec = self.window.record
        if rec is None:
            return {}
        return {"window": rec.id, "phase": str(rec.phase), "stage": rec.timings[-1].stage if rec.timings else None,
                "elapsed_s": round(clock.now() - rec.opened_at, 3)}

    def _on_event(self, event: Event) -> None:
        self.metrics.on_event(event)
        if event["event"] == "phase_entered":
            self._opened.set()
        if self.textfile is not None:
            self.textfile.request()
        if self.hooks is not None:
            self.hooks.on_event(event)

    def _window_finished(self, record: Finished) -> None:
        try:
            self.metrics.window_finished(record)
        except Exception as err:  # the metrics' bug must not keep the window from finishing
            log.exception("metrics_window_not_observed", window=record.id, error=repr(err))

    async def _tick(self) -> None:
        """Refresh STATUS= (and the textfile) once a second while a window is open; sleep while IDLE."""
        while True:
            if self.window.phase is Phase.IDLE:
                self._opened.clear()
                await self._opened.wait()
                continue
            self.window.notify_status()
            if self.textfile is not None:
                self.textfile.request()
            await asyncio.sleep(TICK_S)
