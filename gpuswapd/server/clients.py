"""The connections a server serves: each one's task kept, and each counted out and closed however it ends.

Both servers use it: the Unix socket's and the ``/metrics`` scrape server's. What each does
before a connection is admitted (its accept loop) and while it is served (its protocol) is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from gpuswapd.server.admission import Admission
from gpuswapd.server.peers import Peer

DROP_S = 2.0   # how long a closing server waits for its connections' tasks to end
CLOSE_S = 1.0  # how long a connection's close may wait for the other end


class Clients:
    """The tasks serving a server's admitted connections, dropped together when it closes."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self._tasks: set[asyncio.Task[Any]] = set()

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a connection's task until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drop(self) -> None:
        """Cancel every connection's task, and wait a little for them to end."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=DROP_S)

    @contextlib.asynccontextmanager
    async def serving(self, peer: Peer, writer: asyncio.StreamWriter) -> AsyncIterator[None]:
        """Count an admitted connection out of the caps and close it, however serving it ends."""
        try:
            yield
        finally:
            self.admission.leave(peer)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), CLOSE_S)
