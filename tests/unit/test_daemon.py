"""The daemon's lifecycle on the fakes: signals set flags, a second forces the exit; the bound runs from the signal."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

# The daemon imports the D-Bus adapter: a build without PyGObject (makepkg's check() on a bare
# system Python) cannot import it.
pytest.importorskip("gpuswapd.daemon", exc_type=ImportError)

from gpuswapd import clock, daemon
from gpuswapd.daemon import Daemon, Systems
from tests.fakes import FakeWorld


def test_the_first_signal_stops_and_a_second_forces_without_leaving_the_loop() -> None:
    async def main() -> None:
        fw = FakeWorld()
        d = Daemon(fw.config, systems=Systems(fw.systemd, fw.docker, fw.http, fw.gpu, fw.store))  # type: ignore[arg-type]
        d.window.writer.start()
        d._on_signal(signal.SIGTERM)
        assert d._stop.is_set() and not d.forced and not d.window.abort.is_set()
        d._on_signal(signal.SIGINT)  # no SystemExit raised inside the loop's callback
        assert d.forced and d.window.abort.is_set()
        assert await d.shutdown() == 1  # forced: the exit status says the GPU may not be back

    asyncio.run(main())


def test_the_shutdown_bound_counts_from_the_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Asking systemd whether the whole system stops took the bound itself (a hung bus, say): the
    # close gets no more time after it, so the whole shutdown stays within the units' TimeoutStopSec=.
    world = FakeWorld()
    gpuswapd = Daemon(world.config, systems=Systems(world.systemd, world.docker, world.http,  # type: ignore[arg-type]
                                                    world.gpu, world.store))  # type: ignore[arg-type]
    lost = 0.0

    def slow_system_state() -> str:
        nonlocal lost
        lost += daemon.SHUTDOWN_BOUND_S + 1.0
        return "running"

    async def main() -> Any:
        await gpuswapd.connect()
        await gpuswapd.begin()
        await gpuswapd.window.acquire("holder", 600)
        world.systemd.fail_starts["strata.service"] = 1_000_000  # the resident never starts again
        monkeypatch.setattr(world.systemd, "system_state", slow_system_state)
        clock.use(time.time, lambda: time.monotonic() + lost)
        try:
            return await asyncio.wait_for(gpuswapd.shutdown(), 30)
        finally:
            clock.reset()

    assert asyncio.run(main()) == 1  # the GPU was not given back: not 0
    assert world.store.document is not None and world.store.document.window is not None  # kept for the next start


def test_the_metrics_of_an_instance_carry_its_name() -> None:
    # gpuswapd@1 and gpuswapd@2 scraped by one Prometheus: each series must say which card it is of.
    world = FakeWorld()
    gpuswapd = Daemon(world.config, systems=Systems(world.systemd, world.docker, world.http,  # type: ignore[arg-type]
                                                    world.gpu, world.store), instance="1")  # type: ignore[arg-type]
    exposition = gpuswapd.observers.metrics.exposition().decode()
    assert 'gpuswapd_leases{instance="1"} 0.0' in exposition
    assert 'instance="default"' not in exposition
