"""Tasks with an owner: every task gpuswapd starts is awaited by someone or has its failure logged.

A task nobody awaits dies silently ("Task exception was never retrieved"). ``spawn`` keeps a
reference until the task ends and logs an unexpected exception with its traceback; a caller
that must react to the failure passes ``on_failure``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

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
    """Cancel a task and wait until it has ended (its outcome is dropped: it was not wanted)."""
    if task is None or task.done():
        if task is not None and not task.cancelled():
            task.exception()  # retrieved: nothing more to say about it
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a finished task's outcome as seen (a cancelled helper whose result nobody needs)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def uncancel() -> None:
    """Forget a cancellation that was caught on purpose, so later timeouts work as usual."""
    task = asyncio.current_task()
    if task is not None:
        while task.cancelling():
            task.uncancel()
