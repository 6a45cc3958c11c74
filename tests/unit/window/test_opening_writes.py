"""What a window changes is on disk before it changes it, in as few writes as that takes."""

from __future__ import annotations

import asyncio
from typing import Any

from gpuswapd.phases import Phase
from gpuswapd.state.store import decode
from tests.fakes import PARK_CONFIG, FakeWorld, running, settle


def test_every_change_is_recorded_before_it_is_made_and_each_phase_that_changes_nothing_overlaps_its_write() -> None:
    fw = FakeWorld(config=PARK_CONFIG)
    written: list[dict[str, Any]] = []
    fw.store.on_write = lambda _clears, data: written.append(_window(data))
    on_disk_at: dict[str, dict[str, Any]] = {}  # the first stop of a timer and of a unit: what the disk said then
    queue = fw.systemd.queue_jobs

    def jobs(method: str, units: list[str]) -> list[tuple[str, str]]:
        kind = "timer" if units[0].endswith(".timer") else "unit"
        if method == "StopUnit" and kind not in on_disk_at:
            on_disk_at[kind] = written[-1]
        return queue(method, units)

    fw.systemd.queue_jobs = jobs  # type: ignore[method-assign]

    async def main() -> None:
        async with running(fw.window()) as w:
            await w.release((await w.acquire("job", 60)).id)  # cold: boots and parks its engine
            await settle(w)
            on_disk_at.clear()
            first = len(written)
            lease = await w.acquire("job", 60)  # warm: wakes the parked engine
            assert written[-1]["phase"] == "READY" and [x["id"] for x in written[-1]["leases"]] == [lease.id]
            opening = written[first:]
            await w.release(lease.id)
            await settle(w)
            assert on_disk_at["timer"]["phase"] == "PAUSING_TIMERS" and on_disk_at["timer"]["timers"]
            assert on_disk_at["unit"]["phase"] == "STOPPING_RESIDENT"
            assert on_disk_at["unit"]["units"] == ["strata.service", "llama-swap.service"]
            phases = [d["phase"] for d in opening]
            # One write per phase that changes something (timers, units, the parked engine taken
            # over, READY with the lease); DRAINING's and WAITING_VRAM's go on while they look.
            assert phases.count("PAUSING_TIMERS") == phases.count("STOPPING_RESIDENT") == 1, phases
            assert phases.count("WAKING") == phases.count("READY") == 1, phases
            assert len(opening) <= 6, phases

    asyncio.run(asyncio.wait_for(main(), 30))
    assert fw.store.history_records[-1]["start"] == "warm"
    assert [t["phase"] for t in fw.store.history_records[-1]["timings"]][:6] == [
        str(p) for p in (Phase.DRAINING, Phase.PAUSING_TIMERS, Phase.STOPPING_RESIDENT, Phase.WAITING_VRAM,
                         Phase.WAKING, Phase.READY)]


def _window(data: bytes) -> dict[str, Any]:
    doc = decode(data)
    return doc.window.to_dict() if doc.window is not None else {"phase": "IDLE", "leases": []}
