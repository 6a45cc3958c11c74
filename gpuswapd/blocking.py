"""Run the synchronous adapters (pydbus, Docker SDK, NVML) off the event loop, and checks together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


async def blocking(func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """Call ``func`` in a worker thread and await its result."""
    return await asyncio.to_thread(func, *args, **kwargs)


async def together(*aws: Awaitable[Any]) -> list[Any]:
    """Run awaitables concurrently; on the first failure cancel the rest and raise that error."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_wrap(aw)) for aw in aws]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [task.result() for task in tasks]


async def _wrap(aw: Awaitable[R]) -> R:
    return await aw
