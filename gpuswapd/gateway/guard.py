"""Connections that cannot exhaust the gateway: uvicorn's httptools protocol, with heads bounded in time and size.

uvicorn has no header read timeout, and its httptools protocol no header size limit (httptools
keeps a header in memory until it is whole). This protocol adds them, and counts what it cuts in
``gpuswapd_gateway_connections_cut_total{reason}``:

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

What it costs a request: one timer armed and cancelled, and a dict entry added and removed
(tests/benchmarks/gateway_bench.py measures the gateway with it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_S = 10.0
MAX_HEAD = 64 * 1024
MAX_PENDING = 1024
MAX_CONNECTIONS = 4096
RETRY_S = 5
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
        self.pending: dict[GuardedProtocol, None] = {}
        self.served = 0  # connections with their heads read
        self.cut = cut


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the head of each request bounded in time and size."""

    heads: ClassVar[Heads]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "new"  # "head": its head is coming; "served": read (a request, or kept alive); "cut"
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def sharing(cls, cut: Callable[[str], None]) -> type[GuardedProtocol]:
        """Return the protocol class for one server, counting its cuts with ``cut(reason)``."""
        return type("GuardedProtocol", (cls,), {"heads": Heads(cut)})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Take the connection; it starts with a head to read."""
        super().connection_made(transport)
        if len(self.heads.pending) >= MAX_PENDING:
            next(iter(self.heads.pending)).cut_off("crowded")
        if self.heads.served >= MAX_CONNECTIONS:
            self.cut_off("full")
            return
        self._begin_head()

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

    def cut_off(self, reason: str) -> None:
        """Answer (408, 431, 503 or nothing) and close the connection."""
        if self._state == "cut" or self.transport is None or self.transport.is_closing():
            return
        self._leave()
        self._state = "cut"
        self.heads.cut(reason)
        if ANSWERS[reason]:
            self.transport.write(ANSWERS[reason])
        self.transport.close()

    def _begin_head(self) -> None:
        self._state = "head"
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(HEAD_S, self.cut_off, "slow")
        self.heads.pending[self] = None

    def _leave(self) -> None:
        """Leave the state the connection is in (its head's timer, or its place among those served)."""
        if self._state == "head":
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self.heads.pending.pop(self, None)
        elif self._state == "served":
            self.heads.served -= 1
        self._state = "new"
