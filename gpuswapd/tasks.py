"""Tasks with an owner: every task gpuswapd starts is awaited by someone or has its failure logged.

A task nobody awaits dies silently ("Task exception was never retrieved"). ``spawn`` keeps a
reference until the task ends and logs an unexpected exception with its traceback; a caller
that must react to the failure passes ``on_failure``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from gpuswapd import clock, naps, workers
from gpuswapd.logs import log

T = TypeVar("T")

_running: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T], name: str,
          on_failure: Callable[[BaseException], None] | None = None) -> asyncio.Task[T]:
    """Start a task that is never lost: its failure is logged (and handed to ``on_failure``)."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _running.add(task)

    def done(t: asyncio.Task[T]) -> None:
        _running.discard(t)
        if t.cancelled():
            return
        err = t.exception()
        if err is None:
            return
        log.error("task_failed", task=name, error=repr(err), exc_info=err)
        if on_failure is not None:
            on_failure(err)

    task.add_done_callback(done)
    return task


async def reap(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task and wait until it has ended (its outcome is dropped: it was not wanted).

    Python 3.11's ``asyncio.wait_for`` can swallow a cancellation that arrives as its inner
    await completes: cancel again until the task is really gone.
    """
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if task is not None and not task.cancelled():
        task.exception()  # retrieved: nothing more to say about it


async def sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``, waking early when ``event`` is set; tell whether it is.

    The seconds are counted on ``CLOCK_BOOTTIME``: a suspend meanwhile counts (``naps``).

    Unlike ``wait_for`` with a suppressed TimeoutError, a cancellation always gets through.
    """
    return await naps.sleep_until(clock.monotonic() + seconds, event)


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a finished task's outcome as seen (a cancelled helper whose result nobody needs)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def together(*aws: Awaitable[Any]) -> list[Any]:
    """Run awaitables concurrently; on the first failure cancel the rest and raise that error.

    Not a TaskGroup: Python 3.11's leaves its parent task cancelling when a child fails while the
    group's end is awaited, so a later cancellation the parent catches on purpose (an opening
    whose last client went away) would read as its own.
    """
    children = [asyncio.create_task(_wrap(aw)) for aw in aws]
    for t in children:
        retrieve(t)  # a second failure, or one while cancelled, is not worth a warning
    try:
        await asyncio.wait(children, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:  # the caller is cancelled: its children go first
        await _cancel_all(children)
        raise
    await _cancel_all(children)  # one failed: the rest go
    for t in children:
        if not t.cancelled() and (err := t.exception()) is not None:
            raise err
    return [t.result() for t in children]


async def _cancel_all(children: list[asyncio.Task[Any]]) -> None:
    """Cancel the children still running and wait until they have ended (cancelling them again if interrupted)."""
    pending = [t for t in children if not t.done()]
    while pending:
        for t in pending:
            t.cancel()
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            await asyncio.wait(pending)
            raise
        pending = [t for t in pending if not t.done()]


async def _wrap(aw: Awaitable[T]) -> T:
    return await aw


def uncancel() -> None:
    """Forget a cancellation that was caught on purpose, so later timeouts work as usual."""
    task = asyncio.current_task()
    if task is not None:
        while task.cancelling():
            task.uncancel()


def in_daemon_thread(func: Callable[..., T], *args: Any, name: str) -> asyncio.Future[T]:
    """Run a blocking call on a daemon thread of its own, one that never keeps gpuswapd from exiting.

    For a call with no deadline of its own that must neither hold a worker of a shared pool nor
    block the exit if it hangs (a write to a stuck filesystem, a wait for a container's exit).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def done(result: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: gpuswapd is exiting
            loop.call_soon_threadsafe(settle, result, error)

    workers.own_thread(name).submit(lambda: func(*args), done)
    return future
