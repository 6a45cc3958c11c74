"""What a starting gpuswapd finds: the window an earlier one left, the baseline, orphaned engines."""

from __future__ import annotations

import asyncio
import contextlib

from gpuswapd.closing import sweep_orphans
from gpuswapd.errors import GpuswapError
from gpuswapd.logs import log
from gpuswapd.state import Loaded
from gpuswapd.tasks import uncancel
from gpuswapd.window import Window

READ_ATTEMPTS = 3  # a read that fails may be a moment's trouble; three that fail are the disk's


async def recover_at_start(window: Window) -> None:
    """Pick up the state an earlier gpuswapd left, or restore the baseline if none can be read."""
    loaded: Loaded | None = None
    problem = ""
    for attempt in range(READ_ATTEMPTS):
        try:
            loaded = await window.outside.state.call("read", window.store.load)
            problem = "; ".join(loaded.problems)
            break
        except (GpuswapError, OSError, asyncio.CancelledError) as err:  # EIO, a hung disk, an interruption
            problem = _why(err, window)
            log.error("state_read_failed", error=problem, attempt=attempt + 1, of=READ_ATTEMPTS)
            lane = window.outside.state
            # A read that outlived its deadline holds the lane: give it a while to come back.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lane.drained(), lane.deadline)
            await asyncio.sleep(window.backoffs.driver[0] * 2**attempt)
    if loaded is not None and loaded.problems:
        log.error("state_unreadable", problems=loaded.problems, fell_back=loaded.document is not None)
    if loaded is not None and loaded.migrated:
        log.info("state_migrated", to="state.json", version=2)
    document = loaded.document if loaded is not None else None
    window.writer.start(document.seq if document else 0)
    if loaded is None or loaded.unreadable:
        window.restore_baseline(f"no copy of the state could be read ({problem})")
        return  # the baseline takes the configured engine down itself
    record = document.window if document is not None else None
    if record is not None:
        window.recover(record)
    # Reconcile before serving: nobody sees an engine no record knows about.
    try:
        await window.engine.remove_orphans(record.id if record is not None and record.container else None)
    except (GpuswapError, asyncio.CancelledError) as err:
        log.warning("orphan_check_failed", error=_why(err, window), retry="in the background")
        sweep_orphans(window)


def _why(err: BaseException, window: Window) -> str:
    """Say what went wrong; an interruption at start is nobody's request, so it is only noted."""
    if isinstance(err, asyncio.CancelledError):
        uncancel()  # nothing stops gpuswapd while it starts: carry on
        return "interrupted"
    if isinstance(err, GpuswapError):
        return err.message
    return f"{window.store.dir}: {getattr(err, 'strerror', None) or err}"
