"""Write the window record off the event loop; saves that arrive together share one write.

Callers await their save: a phase is on disk before it acts, a lease before its client hears of
it. A burst of grants costs one fsync'd write, not one each.
"""

from __future__ import annotations

import asyncio
import json

from gpuswapd.blocking import blocking
from gpuswapd.errors import GpuswapError
from gpuswapd.record import WindowRecord
from gpuswapd.state import StateStore


class Saver:
    """Group commit of the current window record."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._lock = asyncio.Lock()
        self._queued: WindowRecord | None = None
        self._done: asyncio.Future[None] | None = None

    async def save(self, record: WindowRecord) -> None:
        """Persist ``record``; return once it is on disk as it is now (or newer)."""
        self._queued = record
        if self._done is not None and not self._done.done():
            await asyncio.shield(self._done)  # ride on the write already queued
            return
        done = self._done = asyncio.get_running_loop().create_future()
        async with self._lock:  # one write at a time, in order
            # Serialized as late as possible: one snapshot holds every change queued so far.
            queued, self._queued, self._done = self._queued, None, None
            assert queued is not None
            data = json.dumps(queued.to_dict(), separators=(",", ":")).encode()
            try:
                await blocking(self.store.write_current, data)
            except OSError as err:
                failure = GpuswapError(f"cannot write the state file in {self.store.dir}: {err.strerror}; "
                                       "gpuswapd cannot promise to undo this window after a crash")
                done.set_exception(failure)
                done.exception()  # retrieved: the caller below raises it
                raise failure from err
            done.set_result(None)
