"""systemd jobs awaited from asyncio: each JobRemoved signal resolves a future; no thread waits."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from gpuswapd.errors import JobFailed
from gpuswapd.outside import Lane

if TYPE_CHECKING:  # the D-Bus adapter needs PyGObject, which tests of the logic do without
    from gpuswapd.adapters.systemd import Systemd


async def run_jobs(systemd: Systemd, lane: Lane, method: str, units: list[str], timeout: float,
                   verb: str) -> None:
    """Queue a start or stop job for each unit together and await their results within ``timeout``."""
    if units:
        # The lane's own deadline only backs up the job timeout below, which names each unit.
        await lane.run("job", _jobs(systemd, lane, method, units, timeout, verb), timeout + 2 * lane.deadline)


async def _jobs(systemd: Systemd, lane: Lane, method: str, units: list[str], timeout: float, verb: str) -> None:
    loop = asyncio.get_running_loop()
    queued = await lane.call("queue_jobs", systemd.queue_jobs, method, units)
    waits: dict[str, asyncio.Future[str]] = {}

    def settle(future: asyncio.Future[str], result: str) -> None:
        if not future.done():
            future.set_result(result)

    for _, path in queued:
        future = waits[path] = loop.create_future()

        def done(result: str, future: asyncio.Future[str] = future) -> None:  # from the signal thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: gpuswapd is exiting
                loop.call_soon_threadsafe(settle, future, result)

        systemd.when_job_done(path, done)
    try:
        await asyncio.wait(waits.values(), timeout=timeout)
    finally:
        for path, future in waits.items():
            if not future.done():
                systemd.forget_job(path)
    failures = []
    for unit, path in queued:
        future = waits[path]
        if not future.done():
            failures.append(f"{verb} of {unit} did not finish within {timeout:g}s")
        elif (result := future.result()) != "done":
            state = await lane.call("unit_state", systemd.state, unit)
            failures.append(f"{verb} of {unit} ended with result '{result}' (now {state.active_state}/"
                            f"{state.sub_state}); see `journalctl -u {unit}`")
    if failures:
        raise JobFailed("; ".join(failures))
