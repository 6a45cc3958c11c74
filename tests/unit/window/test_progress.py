"""systemd's STATUS= line: how far the phase has come, beside what is amiss; gpuswapctl watch's lines."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from gpuswapd.adapters.gpu import VramReading
from gpuswapd.ctl.render import event_line
from gpuswapd.events import to_event
from gpuswapd.notify import Notifier
from gpuswapd.phases import Phase
from gpuswapd.record import PhaseTiming, WindowRecord
from tests.fakes import FakeWorld, GiB


def _status_lines(tmp_path: Path, phase: Phase) -> str:
    world = FakeWorld()
    path = tmp_path / f"notify-{phase}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(1)

    async def main() -> None:
        w = world.window()
        w.notifier = Notifier(str(path))
        rec = w.record = WindowRecord.new()
        rec.phase = phase
        rec.timings.append(PhaseTiming(phase, time.time() - 35.2))
        if phase is Phase.READY:
            rec.leases.grant("a", 60, time.time())
            rec.leases.grant("b", 60, time.time())
        w.vram.last = VramReading(total_bytes=24 * GiB, free_bytes=int(3.1 * GiB), used_bytes=0, processes=())
        w.notify_status()

    asyncio.run(main())
    try:
        return listener.recv(4096).decode()
    finally:
        listener.close()


def test_status_says_how_far_each_phase_has_come(tmp_path: Path) -> None:
    assert _status_lines(tmp_path, Phase.WAITING_VRAM).startswith("STATUS=WAITING_VRAM 3.1/21.0 GiB free (window ")
    assert _status_lines(tmp_path, Phase.BOOTING).startswith("STATUS=BOOTING 35s of 0s (window ")  # boot_timeout 300ms
    assert _status_lines(tmp_path, Phase.READY).startswith("STATUS=READY, 2 leases (window ")
    assert _status_lines(tmp_path, Phase.DRAINING).startswith("STATUS=DRAINING (window ")


def test_watch_lines_read_as_a_sentence() -> None:
    event = to_event("phase_entered", "info", {"elapsed_s": 3.14},
                     {"window": "20250101-120000-abcdef", "phase": "BOOTING", "stage": "open"})
    line = event_line(event)
    assert "phase_entered" in line and "20250101-120000-abcdef BOOTING/open +3.1s" in line
    failed = event_line(to_event("window_failed", "error", {"error": "port 18020 in use", "code": "window_failed"}, {}))
    assert "[error]" in failed and 'error="port 18020 in use"' in failed and "code=window_failed" in failed
    assert "watching" in event_line({"event": "subscribed"})
