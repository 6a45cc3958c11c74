"""The metrics textfile for node_exporter: replaced atomically, written at most once a second.

node_exporter's textfile collector reads every ``*.prom`` file of its directory whenever it is
scraped: a file half written would be read half. So the metrics go to a temporary name in the
same directory that does not end in ``.prom`` and are renamed over the file (rename(2) is atomic
within a filesystem). The mode is set to 0644 explicitly: gpuswapd.service has UMask=0077, and
node_exporter runs as another user.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable
from pathlib import Path

from gpuswapd import clock, ids
from gpuswapd.logs import log
from gpuswapd.tasks import in_daemon_thread, reap, spawn

MIN_INTERVAL_S = 1.0
MODE = 0o644


_writes = itertools.count()
_ATTEMPTS = 3  # a name taken already (a file, or a link someone planted there) is skipped for another


def temporary_name(path: Path) -> Path:
    """Name a file to write before the rename: hidden, not ``*.prom``, unguessable, never another write's."""
    return path.with_name(f".{path.name}.{os.getpid()}-{next(_writes)}-{ids.token(8)}.tmp")


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a part.

    The temporary file is made new (O_EXCL) and never through a link (O_NOFOLLOW), as the state
    store makes its own: a link planted under that name cannot turn the write onto another file.
    """
    for attempt in range(_ATTEMPTS):
        tmp = temporary_name(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, MODE)
        except FileExistsError:
            if attempt == _ATTEMPTS - 1:
                raise
            continue
        try:
            with open(fd, "wb") as out:
                os.fchmod(out.fileno(), MODE)  # whatever the umask
                out.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return


class Textfile:
    """Writes the metrics to a file when asked, coalescing requests to one write a second at most."""

    def __init__(self, path: str | Path, render: Callable[[], bytes], min_interval: float = MIN_INTERVAL_S) -> None:
        self.path = Path(path)
        self._render = render
        self._min_interval = min_interval
        self._wanted = False
        self._last = -min_interval
        self._task: asyncio.Task[None] | None = None
        self._failing: str | None = None
        self.writes = 0

    def request(self) -> None:
        """Ask for a write of the metrics as they are then (soon, and at most once a second)."""
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = spawn(self._run(), "metrics-textfile")

    async def _run(self) -> None:
        while self._wanted:
            # Rate limiting, not waiting for something outside: a burst of events makes one write.
            await asyncio.sleep(max(0.0, self._last + self._min_interval - clock.monotonic()))
            self._wanted = False
            await self._write()
            self._last = clock.monotonic()

    async def _write(self) -> None:
        # One write at a time, on a thread of its own: a stuck filesystem holds up only this file.
        try:
            await in_daemon_thread(write_atomically, self.path, self._render(), name="metrics-textfile")
        except OSError as err:
            why = err.strerror or str(err)
            if why != self._failing:
                log.error("metrics_textfile_failed", path=str(self.path), error=why)
            self._failing = why
            return
        self.writes += 1
        if self._failing is not None:
            log.info("metrics_textfile_written_again", path=str(self.path))
            self._failing = None

    async def close(self, timeout: float = 2.0) -> None:
        """Write the last state (within ``timeout``) and stop."""
        await reap(self._task)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._write()
