"""The single writer of the state directory: off the event loop, group-committed, cancel-safe.

Callers ask for a save and may wait until a write covers it. The writer task alone does the
work and alone resolves what callers wait on, so a caller that is cancelled (a client that
hung up) leaves nothing unresolved behind it. Saves that arrive while a write is in flight are
covered together by the next one, serialized as late as possible.

A failed write (a full disk, EMFILE, a hung filesystem) is retried with backoff until one
succeeds; meanwhile ``writable`` is False and ``error`` says why, and each waiter covered by a
failed attempt gets the error at once, to decide for itself: opening rolls back, closing
carries on with the record it holds in memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpuswapd import clock
from gpuswapd.errors import GpuswapError, StateError
from gpuswapd.logs import log
from gpuswapd.outside import Lane
from gpuswapd.record import Finished
from gpuswapd.retry import backoff
from gpuswapd.state.store import Document, StateStore, encode
from gpuswapd.tasks import reap, sleep_unless, spawn, uncancel

BACKOFF_S = (0.2, 30.0)


class StateWriter:
    """Writes the state document and appends history, one write at a time, in order."""

    def __init__(self, store: StateStore, lane: Lane, snapshot: Callable[[], Document],
                 backoff: tuple[float, float] = BACKOFF_S) -> None:
        self.store = store
        self.lane = lane
        self._snapshot = snapshot
        self._backoff = backoff
        self._wanted = 0    # the newest change asked for
        self._written = 0   # the newest change on disk
        self._failed = 0    # the newest change a failed attempt covered
        self._history: list[Finished] = []
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()  # someone waits for a write: a failed one is retried at once
        self._progress = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.seq = 0
        self.error: str | None = None
        self.failed_since: float | None = None
        self.on_change: Callable[[], None] = lambda: None
        self.on_writable: Callable[[], None] = lambda: None  # the state directory answers again
        self._stopped = False

    @property
    def writable(self) -> bool:
        """Tell whether the last write succeeded."""
        return self.error is None

    @property
    def pending(self) -> bool:
        """Tell whether a change is not on disk yet."""
        return self._written < self._wanted

    def start(self, seq: int = 0) -> None:
        """Start the writer task (after the document was loaded, continuing its ``seq``)."""
        self.seq = seq
        self._task = spawn(self._run(), "state-writer", on_failure=self._crashed)

    async def stop(self, timeout: float) -> bool:
        """Write what is pending (within ``timeout``), then end the writer task; tell whether all of it is on disk."""
        if self.pending:
            try:
                await asyncio.wait_for(self.save_now(), timeout)
            except (TimeoutError, GpuswapError) as err:
                log.error("state_not_saved_at_exit", error=getattr(err, "message", repr(err)))
        self._stopped = True
        await reap(self._task)
        return not self.pending

    def request(self) -> int:
        """Ask for a write of the current state; return the change number that covers it."""
        self._wanted += 1
        self._dirty.set()
        return self._wanted

    def add_history(self, record: Finished) -> int:
        """Queue a finished window for the history; it is written before the next document."""
        self._history.append(record)
        return self.request()

    async def save(self) -> None:
        """Write the current state; return when it is on disk, raise StateError if that failed."""
        self._urgent.set()
        await self.wait(self.request())

    async def save_now(self) -> None:
        """Write what is pending, if anything; as ``save``."""
        if self.pending:
            await self.wait(self._wanted)

    async def wait(self, change: int) -> None:
        """Wait until a write covered ``change``; StateError if the attempt that covered it failed."""
        async with self._progress:
            await self._progress.wait_for(lambda: self._written >= change or self._failed >= change)
        if self._written < change:
            raise StateError(self.error or "the state could not be written")

    async def _run(self) -> None:
        failures = 0
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self._urgent.clear()
            change = self._wanted
            history = list(self._history)
            document = self._snapshot()
            document.seq = self.seq + 1
            data = encode(document)  # serialized as late as possible: one write covers every change so far
            try:
                if history:
                    await self.lane.call("append_history", self.store.append_history, [r.to_dict() for r in history])
                    del self._history[:len(history)]
                await self.lane.call("write", self.store.write, data)
            except (GpuswapError, OSError, asyncio.CancelledError) as err:
                if isinstance(err, asyncio.CancelledError):
                    if self._stopped:
                        raise
                    uncancel()  # nobody asked the writer to stop: the state must still reach the disk
                await self._failed_attempt(change, err)
                failures += 1
                # A client waiting on a write tries again now.
                await sleep_unless(self._urgent, backoff(self._backoff, failures))
                self._dirty.set()  # try again: the state must reach the disk
                continue
            self.seq = document.seq
            failures = 0
            if self.error is not None:
                log.info("state_writable_again", state_dir=str(self.store.dir),
                         after_s=round(clock.monotonic() - (self.failed_since or clock.monotonic()), 1))
                self.error, self.failed_since = None, None
                self.on_change()
                self.on_writable()
            async with self._progress:
                self._written = max(self._written, change)
                self._progress.notify_all()

    async def _failed_attempt(self, change: int, err: BaseException) -> None:
        if isinstance(err, GpuswapError):
            why = err.message
        elif isinstance(err, OSError):
            why = err.strerror or str(err)
        else:
            why = f"the write was interrupted ({type(err).__name__})"
        message = (f"cannot write the state in {self.store.dir}: {why}; gpuswapd keeps the window in memory "
                   "and retries")
        first = self.error is None
        self.error = message
        if first:
            self.failed_since = clock.monotonic()
            log.error("state_write_failed", error=why, state_dir=str(self.store.dir))
            self.on_change()
        async with self._progress:
            self._failed = max(self._failed, change)
            self._progress.notify_all()

    def _crashed(self, err: BaseException) -> None:
        # A bug in the writer: start it again (its state is in this object), and say so.
        self.error = f"the state writer failed ({type(err).__name__}); restarted"
        self._task = spawn(self._run(), "state-writer", on_failure=self._crashed)
        self._dirty.set()
