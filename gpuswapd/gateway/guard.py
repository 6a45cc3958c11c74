"""Connections that cannot exhaust the gateway: uvicorn's httptools protocol, with heads bounded in time and size.

uvicorn has no header read timeout, and its httptools protocol no header size limit (httptools
keeps a header in memory until it is whole). A new connection is a ``HeadGuard`` until its first
head is whole, and only then uvicorn's protocol (``GuardedProtocol``, which bounds the heads of a
kept-alive connection alike): a flood of heads that never finish costs an accept and a small
object each, not a parser. What is cut is counted in ``gpuswapd_gateway_connections_cut_total{reason}``:

- ``slow``: a request's head (request line and headers) must arrive within ``HEAD_S`` of its
  first byte (of the connection, or of the request on a kept-alive one): else 408 and the
  connection is closed.
- ``large``: a head larger than ``MAX_HEAD`` gets 431 and the connection is closed; at most one
  read of the socket more than that is ever held.
- ``crowded``: at most ``MAX_PENDING`` connections may be sending their heads at once; one more
  closes the oldest of them (a slow client's, the likeliest), so that a fresh client is never
  kept out by connections that never finish their heads.
- ``full``: past ``MAX_CONNECTIONS`` connections with their heads read, a new one gets 503 with
  Retry-After (what uvicorn's ``limit_concurrency`` did, without a Retry-After, and counting the
  heads still coming).

First bytes that cannot begin a request line (not a method of A-Z) go to httptools at once,
which answers 400 as it always did.

What it costs a request: one timer armed and cancelled, and a dict entry added and removed; a
new connection's first head is also searched for its end once more, and handed over once
(tests/benchmarks/gateway_bench.py measures the gateway with it).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, ClassVar, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_S = 10.0
MAX_HEAD = 64 * 1024
MAX_PENDING = 1024
MAX_CONNECTIONS = 4096
RETRY_S = 5
METHOD_MAX = 20  # bytes of a request line's method: longer, or not A-Z, is not HTTP
_METHOD = re.compile(rb"[A-Z_-]{0,%d}(?: |\Z)" % METHOD_MAX)
_CLOSE = b"content-length: 0\r\nconnection: close\r\n"
ANSWERS = {
    "slow": b"HTTP/1.1 408 Request Timeout\r\n" + _CLOSE + b"\r\n",
    "large": b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + _CLOSE + b"\r\n",
    "full": b"HTTP/1.1 503 Service Unavailable\r\nretry-after: " + str(RETRY_S).encode() + b"\r\n" + _CLOSE + b"\r\n",
    "crowded": b"",
}


class Heads:
    """What the guarded connections share: those sending their heads now, oldest first, and the cut counter."""

    def __init__(self, cut: Callable[[str], None]) -> None:
        self.pending: dict[_Guarded, None] = {}
        self.served = 0  # connections with their heads read
        self.cut = cut


def protocol(cut: Callable[[str], None]) -> type[HeadGuard]:
    """Return the protocol class for one uvicorn server (``uvicorn.Config(http=...)``), counting cuts with ``cut``."""
    heads = Heads(cut)
    served = type("GuardedProtocol", (GuardedProtocol,), {"heads": heads})
    return type("HeadGuard", (HeadGuard,), {"heads": heads, "served": served})


class _Guarded:
    """What both stages of a connection share: its head's timer and place among those coming, and the cut."""

    heads: ClassVar[Heads]
    transport: Any
    _state: str
    _timer: asyncio.TimerHandle | None

    def cut_off(self, reason: str) -> None:
        """Answer (408, 431, 503 or nothing) and close the connection."""
        if self._state in ("cut", "handed") or self.transport is None or self.transport.is_closing():
            return
        self._leave()
        self._state = "cut"
        self.heads.cut(reason)
        if ANSWERS[reason]:
            self.transport.write(ANSWERS[reason])
        self.transport.close()

    def _leave(self) -> None:
        raise NotImplementedError

    def _leave_head(self) -> None:
        """Stop the head's clock and leave the heads coming."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.heads.pending.pop(self, None)


class HeadGuard(_Guarded, asyncio.Protocol):
    """A new connection until its first head is whole: bounded in time, size and number, and cheap to cut.

    A flood (thousands of heads that never finish, cut as crowded and coming back) costs the
    gateway an accept, this small object and a timer each; uvicorn's protocol (an httptools
    parser, its loggers, the addresses) is built only for a connection whose head is whole, or
    whose first bytes are not an HTTP method (httptools answers those 400 at once, as before).
    """

    served: ClassVar[type[GuardedProtocol]]

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs  # uvicorn's (config, server_state, app_state, _loop): for the protocol taking over
        self._connections: set[Any] = kwargs["server_state"].connections
        self._buffer = bytearray()
        self._state = "new"  # "head": its head is coming; "cut"; "handed": uvicorn's protocol took over
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection: the oldest head coming goes if too many are, a new one is refused when full."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class, but is one
        self._connections.add(self)  # uvicorn's graceful shutdown closes it (shutdown below)
        heads = self.heads
        if len(heads.pending) >= MAX_PENDING:
            next(iter(heads.pending)).cut_off("crowded")
        if heads.served >= MAX_CONNECTIONS:
            self.cut_off("full")
            return
        self._state = "head"
        self._timer = asyncio.get_running_loop().call_later(HEAD_S, self.cut_off, "slow")
        heads.pending[self] = None

    def data_received(self, data: bytes) -> None:
        """Keep the head's bytes until it is whole (a blank line), then hand the connection to uvicorn's protocol."""
        if self._state != "head":
            return
        buffer = self._buffer
        start = max(0, len(buffer) - 2)
        buffer += data
        end = _head_end(buffer, start)
        if end < 0 and not _METHOD.match(buffer, 0, METHOD_MAX + 1):
            end = 0  # not an HTTP request line: httptools says what is wrong with it
        if end > MAX_HEAD or (end < 0 and len(buffer) > MAX_HEAD):
            self.cut_off("large")
        elif end >= 0:
            self._hand_over()

    def eof_received(self) -> bool | None:
        """Close a connection whose client stopped sending before its head was whole (nothing to answer)."""
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection."""
        self._leave()
        self._state = "cut"
        self._connections.discard(self)

    def shutdown(self) -> None:
        """Close it at uvicorn's graceful shutdown: a head still coming is not waited for."""
        if self.transport is not None:
            self.transport.close()

    def _hand_over(self) -> None:
        """Give the connection and its bytes so far to uvicorn's protocol (guarded for the heads that follow)."""
        self._leave()
        self._state = "handed"
        self._connections.discard(self)
        assert self.transport is not None
        taking = self.served(**self._kwargs)
        self.transport.set_protocol(taking)
        taking.take_over(self.transport, bytes(self._buffer))
        self._buffer = bytearray()

    def _leave(self) -> None:
        if self._state == "head":
            self._leave_head()
        self._state = "new"


def _head_end(buffer: bytearray, start: int) -> int:
    """Return where the head's blank line ends in ``buffer`` (searching from ``start``), or -1."""
    ends = [at + len(blank) for blank in (b"\n\r\n", b"\n\n") if (at := buffer.find(blank, start)) >= 0]
    return min(ends, default=-1)


class GuardedProtocol(_Guarded, HttpToolsProtocol):
    """uvicorn's httptools protocol once a connection's first head was whole: the heads that follow are bounded too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "new"  # "head": its head is coming; "served": read (a request, or kept alive); "cut"
        self._head_bytes = 0
        self._timer = None

    def take_over(self, transport: asyncio.Transport, data: bytes) -> None:
        """Take a connection from its HeadGuard, with the bytes read so far (a whole head, maybe more)."""
        self.connection_made(transport)
        self._state = "head"  # whole already: no timer, not among those coming
        self.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection."""
        self._leave()
        self._state = "cut"
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; a head that grows past MAX_HEAD is cut."""
        if self._state == "cut":
            return
        if self._state == "head":
            self._head_bytes += len(data)
        super().data_received(data)
        if self._state == "head" and self._head_bytes > MAX_HEAD:
            self.cut_off("large")

    def on_message_begin(self) -> None:
        """Start the clock of the next request's head on a kept-alive connection."""
        if self._state == "served":
            self._leave()
            self._begin_head()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        """Stop the head's clock: the request goes on as uvicorn's."""
        if self._state == "head":
            self._leave()
            self._state = "served"
            self.heads.served += 1
        super().on_headers_complete()

    def _begin_head(self) -> None:
        self._state = "head"
        self._head_bytes = 0
        self._timer = self.loop.call_later(HEAD_S, self.cut_off, "slow")
        self.heads.pending[self] = None

    def _leave(self) -> None:
        """Leave the state the connection is in (its head's timer, or its place among those served)."""
        if self._state == "head":
            self._leave_head()
        elif self._state == "served":
            self.heads.served -= 1
        self._state = "new"
