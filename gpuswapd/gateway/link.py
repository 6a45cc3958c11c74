"""gpuswapd's socket, asynchronously: one JSON line each way, as ``gpuswapd.protocol`` defines them.

``request`` is one request on a connection of its own. ``acquire`` keeps its connection: the lease
is bound to it (``"bind": "connection"``), so it ends when the gateway closes it or dies, and the
lease's events (``preempting``, ``preempted``) come on it. ``watch`` follows gpuswapd's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gpuswapd.errors import GpuswapError
from gpuswapd.protocol import encode

LINE_LIMIT = 16 * 1024 * 1024  # status and history replies may be long
REQUEST_S = 15.0  # a status, renew or release that takes longer: gpuswapd is not answering
CONNECT_S = 5.0

Events = Callable[[dict[str, Any]], None]


class LinkDown(GpuswapError):
    """gpuswapd cannot be reached, or the connection to it ended."""

    code = "gpuswapd_unreachable"


@dataclass(eq=False)
class Held:
    """A lease bound to the connection it was acquired on; closing the connection ends it."""

    lease: dict[str, Any]
    profile: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    token: str | None = None  # its reclaim token: sent again after a restart of gpuswapd, the lease is kept

    @property
    def id(self) -> str:
        """Return the lease's id."""
        return str(self.lease["id"])

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Yield the lease's events until the connection ends (gpuswapd stopped, or it was closed)."""
        try:
            while line := await self.reader.readline():
                with contextlib.suppress(ValueError):
                    data = json.loads(line)
                    if isinstance(data, dict) and "event" in data:
                        yield data
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.ended.set()

    async def close(self) -> None:
        """Hang up: gpuswapd ends the lease (it is bound to this connection)."""
        self.ended.set()
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2)


class Link:
    """Talks to one gpuswapd at its socket."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            async with asyncio.timeout(CONNECT_S):
                return await asyncio.open_unix_connection(self.path, limit=LINE_LIMIT)
        except (OSError, TimeoutError) as err:
            raise LinkDown(f"cannot reach gpuswapd at {self.path}: {getattr(err, 'strerror', None) or err!r} "
                           "(is it running? systemctl status gpuswapd.socket)") from None

    async def request(self, message: dict[str, Any], timeout: float = REQUEST_S) -> dict[str, Any]:
        """Send one request on a connection of its own; return the reply or raise its error."""
        reader, writer = await self._connect()
        try:
            async with asyncio.timeout(timeout):
                writer.write(encode(message))
                await writer.drain()
                return await _reply(reader, None, self.path)
        except TimeoutError:
            raise LinkDown(f"gpuswapd at {self.path} did not answer {message.get('op')} within {timeout:g}s") from None
        except (ConnectionError, asyncio.IncompleteReadError) as err:
            raise LinkDown(f"lost the connection to gpuswapd at {self.path}: {err!r}") from None
        finally:
            writer.close()

    async def acquire(self, profile: str, duration: float, priority: int, holder: str | None,
                      progress: Events, reclaim: str | None = None) -> Held:
        """Acquire a lease bound to its connection, waiting until the window is READY.

        Cancelled (nobody waits any more), the connection closes and gpuswapd withdraws the
        request: a window nobody else wants is rolled back. ``reclaim``: the token of an acquire
        made before gpuswapd restarted (its ``accepted`` event said it): its lease, or its place
        in the queue, is taken back.
        """
        reader, writer = await self._connect()
        message: dict[str, Any] = {"op": "acquire", "for": duration, "profile": profile, "priority": priority,
                                   "bind": "connection"}
        if holder is not None:
            message["holder"] = holder
        if reclaim is not None:
            message["reclaim"] = reclaim
        try:
            writer.write(encode(message))
            await writer.drain()
            reply = await _reply(reader, progress, self.path)
        except BaseException as err:
            writer.close()
            if isinstance(err, (ConnectionError, asyncio.IncompleteReadError)):
                raise LinkDown(f"lost the connection to gpuswapd at {self.path} while the window opened") from None
            raise
        token = reply.get("token")
        return Held(dict(reply["lease"]), profile, reader, writer, token=token if isinstance(token, str) else reclaim)

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        """Yield gpuswapd's events (``{"event": "subscribed"}`` first) until the connection ends."""
        reader, writer = await self._connect()
        try:
            writer.write(encode({"op": "watch"}))
            await writer.drain()
            while line := await reader.readline():
                data = json.loads(line)
                if not isinstance(data, dict):
                    continue
                if "event" not in data:
                    raise GpuswapError.from_dict(data.get("error") or {"message": "watch refused"})
                yield data
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as err:
            raise LinkDown(f"lost gpuswapd's events at {self.path}: {err!r}") from None
        finally:
            writer.close()
        raise LinkDown(f"gpuswapd at {self.path} ended its events (it stopped, or this watcher fell behind)")


async def _reply(reader: asyncio.StreamReader, progress: Events | None, path: str) -> dict[str, Any]:
    """Read lines until the reply; pass the events before it to ``progress``."""
    while True:
        line = await reader.readline()
        if not line:
            raise LinkDown(f"gpuswapd at {path} closed the connection without a reply (it stopped or restarted)")
        data = json.loads(line)
        if not isinstance(data, dict):
            continue
        if "event" in data:
            if progress is not None:
                progress(data)
            continue
        if not data.get("ok"):
            raise GpuswapError.from_dict(data.get("error") or {"message": "no reason given"})
        return data
