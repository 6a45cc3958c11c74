"""Run the synchronous adapters (pydbus, Docker SDK, NVML) off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


async def blocking(func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """Call ``func`` in a worker thread and await its result."""
    return await asyncio.to_thread(func, *args, **kwargs)
