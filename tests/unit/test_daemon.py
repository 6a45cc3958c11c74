"""The daemon's lifecycle on the fakes: signals set flags, a second one forces the exit."""

from __future__ import annotations

import asyncio
import signal

from gpuswapd.daemon import Daemon, Systems
from tests.fakes import FakeWorld


def test_the_first_signal_stops_and_a_second_forces_without_leaving_the_loop() -> None:
    async def main() -> None:
        fw = FakeWorld()
        daemon = Daemon(fw.config, systems=Systems(fw.systemd, fw.docker, fw.http, fw.gpu, fw.store))  # type: ignore[arg-type]
        daemon.window.writer.start()
        daemon._on_signal(signal.SIGTERM)
        assert daemon._stop.is_set() and not daemon.forced and not daemon.window.abort.is_set()
        daemon._on_signal(signal.SIGINT)  # no SystemExit raised inside the loop's callback
        assert daemon.forced and daemon.window.abort.is_set()
        assert await daemon.shutdown() == 1  # forced: the exit status says the GPU may not be back

    asyncio.run(main())
