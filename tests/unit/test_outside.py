"""Lanes: deadlines, hung calls counted and reported, workers that come and go."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from gpuswapd.errors import DockerUnavailable, GpuProbeError
from gpuswapd.outside import Deadlines, Lane, Outside
from gpuswapd.workers import Threads


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_call_past_its_deadline_fails_counts_as_hung_until_it_returns_and_is_reported() -> None:
    outside = Outside(Deadlines(gpu=0.05))
    release = threading.Event()

    async def main() -> None:
        with pytest.raises(GpuProbeError, match=r"did not answer \(read\) within 0.05s"):
            await outside.gpu.call("read", release.wait)
        assert outside.status()["gpu"]["hung"][0]["call"] == "read" and outside.hung() == ["gpu"]
        drained = asyncio.create_task(outside.gpu.drained())
        await asyncio.sleep(0.02)
        assert not drained.done()
        release.set()
        await asyncio.wait_for(drained, 2)
        assert outside.status()["gpu"]["hung"] == [] and outside.gpu.hung_total == 1

    run(main())


def test_a_hung_call_that_only_looks_is_shown_but_not_counted_for_the_close() -> None:
    outside = Outside(Deadlines(systemd=0.05))
    release = threading.Event()

    async def main() -> None:
        with pytest.raises(Exception, match=r"did not answer \(commands\)"):
            await outside.systemd.call("commands", release.wait)
        assert outside.status()["systemd"]["hung"][0]["call"] == "commands"
        assert outside.systemd.hung_total == 0  # the close does not wait for it (closing.hung_mark)
        with pytest.raises(Exception, match=r"did not answer \(closure\)"):
            await outside.systemd.call("closure", release.wait)
        assert outside.systemd.hung_total == 1
        release.set()
        await asyncio.wait_for(outside.systemd.drained(), 2)

    run(main())


def test_a_lane_whose_every_worker_is_hung_fails_at_once_and_others_are_not_starved() -> None:
    outside = Outside(Deadlines(docker=0.05, systemd=1.0, workers=2))
    release = threading.Event()

    async def main() -> None:
        for _ in range(2):
            with pytest.raises(DockerUnavailable):
                await outside.docker.call("ping", release.wait)
        started = time.monotonic()
        with pytest.raises(DockerUnavailable, match="Docker is hung: 2 call"):
            await outside.docker.call("ping", lambda: None)
        assert time.monotonic() - started < 0.05  # at once, not after another deadline
        assert await outside.systemd.call("timers", lambda: "answered") == "answered"
        release.set()

    run(main())


def test_an_unregistered_call_fails_loudly() -> None:
    async def main() -> None:
        with pytest.raises(AssertionError, match=r"not in outside\.CALLS"):
            await Lane("gpu", 1.0, 1).call("format_the_disk", lambda: None)

    run(main())


def test_workers_that_ended_when_idle_are_started_again() -> None:
    workers = Threads("test", 1)
    workers.IDLE_S = 0.02  # type: ignore[misc]
    done: list[int] = []
    for round_ in range(5):
        event = threading.Event()
        for n in range(3):  # more jobs than workers: they queue
            workers.submit(lambda n=n, event=event: (done.append(n), n == 2 and event.set()), lambda *_: None)
        assert event.wait(2), f"round {round_}: a job was never run"
        time.sleep(0.06)  # the worker ends, idle
    assert len(done) == 15


def test_a_cancelled_call_that_does_not_return_holds_its_worker_and_is_shown_hung(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A prefetch's read told to stop returns within a chunk; one blocked in the kernel (a FIFO, a
    # dead NFS server) does not, and must not be an invisible worker gone.
    monkeypatch.setattr("gpuswapd.outside.CANCELLED_GRACE_S", 0.05)
    outside = Outside(Deadlines(files=60))
    release = threading.Event()

    async def main() -> None:
        reading = asyncio.create_task(outside.files.call("prefetch", release.wait))
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert outside.status()["files"]["hung"] == []  # within the grace: it may be stopping
        await asyncio.sleep(0.2)
        assert [h["call"] for h in outside.status()["files"]["hung"]] == ["prefetch"]
        release.set()
        await outside.files.drained()
        assert outside.status()["files"]["hung"] == []
        quick = asyncio.create_task(outside.files.call("prefetch", time.sleep, 0.01))
        await asyncio.sleep(0)
        quick.cancel()
        await asyncio.sleep(0.2)
        assert outside.status()["files"]["hung"] == []  # returned within the grace: never counted

    run(main())
