"""Hooks: a command run once per chosen event, with the event's JSON on stdin, never holding up the window.

A hook runs beside the window, never in its way: at most ``MAX_RUNNING`` at once (beyond that an
event is dropped, counted and logged), each killed with its process group at ``hooks.timeout``.
Its failure is logged and nothing else happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterable

from gpuswapd import clock
from gpuswapd.events import Event
from gpuswapd.logs import log
from gpuswapd.protocol import finite
from gpuswapd.tasks import reap, spawn

MAX_RUNNING = 4
KEEP_STDERR = 2048  # the end of a failing hook's stderr goes into the log
LOG_DROPS_EVERY_S = 60.0


class Hooks:
    """Runs ``command`` for each event named in ``events``."""

    def __init__(self, command: list[str], events: Iterable[str], timeout: float,
                 dropped: Callable[[], None] = lambda: None, limit: int = MAX_RUNNING) -> None:
        self.command = list(command)
        self.events = frozenset(events)
        self.timeout = timeout
        self.limit = limit
        self._dropped = dropped
        self._running: set[asyncio.Task[None]] = set()
        self._drops = 0
        self._drops_logged_at = -LOG_DROPS_EVERY_S

    @property
    def running(self) -> int:
        """Count the hooks running now."""
        return len(self._running)

    def on_event(self, event: Event) -> None:
        """Run the hook for an event it wants, unless MAX_RUNNING already run (a bus subscriber)."""
        if not self.command or event["event"] not in self.events:
            return
        if len(self._running) >= self.limit:
            self._drop(event)
            return
        task = spawn(self._run(event), "hook")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _drop(self, event: Event) -> None:
        self._dropped()
        self._drops += 1
        now = clock.monotonic()
        if now - self._drops_logged_at >= LOG_DROPS_EVERY_S:
            log.warning("hook_dropped", dropped=self._drops, last=event["event"], running=len(self._running),
                        reason=f"{self.limit} hooks are running already")
            self._drops, self._drops_logged_at = 0, now

    async def _run(self, event: Event) -> None:
        started = clock.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)  # its own group: killed whole
        except OSError as err:
            log.error("hook_failed", hook=self.command[0], on=event["event"], error=err.strerror or str(err))
            return
        try:
            async with asyncio.timeout(self.timeout):
                # As always (hooks match '"event": "x"'); what is not finite is null, as JSON has no Infinity.
                stderr = await _talk(proc, (json.dumps(finite(event), allow_nan=False) + "\n").encode())
                code = await proc.wait()
        except TimeoutError:
            _kill(proc)
            await proc.wait()
            log.error("hook_timed_out", hook=self.command[0], on=event["event"], timeout_s=self.timeout,
                      pid=proc.pid)
            return
        except BaseException:
            _kill(proc)  # gpuswapd is stopping: leave no hook behind
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 1.0)
            raise
        took = round(clock.monotonic() - started, 3)
        if code != 0:
            log.error("hook_failed", hook=self.command[0], on=event["event"], exit_code=code, took_s=took,
                      stderr=stderr.decode(errors="replace").strip()[-KEEP_STDERR:])
        else:
            log.debug("hook_ran", hook=self.command[0], on=event["event"], took_s=took)

    async def close(self) -> None:
        """Stop the hooks still running (gpuswapd is stopping)."""
        for task in list(self._running):
            await reap(task)


async def _talk(proc: asyncio.subprocess.Process, data: bytes) -> bytes:
    """Hand the event to the hook's stdin and keep the end of its stderr (never all of it)."""
    assert proc.stdin is not None and proc.stderr is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a hook that does not read stdin
        proc.stdin.write(data)
        await proc.stdin.drain()
    proc.stdin.close()
    kept = b""
    while chunk := await proc.stderr.read(65536):
        kept = (kept + chunk)[-KEEP_STDERR:]
    return kept


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
