"""Connections between a simulated client and the daemon's socket server, in memory.

The client writes request lines into the server's ``StreamReader``; the server writes into a
transport whose bytes the client reads when it chooses to. What the client has not read fills a
kernel-sized buffer first; beyond that the bytes stay in the daemon's own memory
(``get_write_buffer_size``), as with a real socket, and past asyncio's high-water mark the
server's ``drain()`` waits.
"""

from __future__ import annotations

import asyncio
from typing import Any

KERNEL_BYTES = 8 * 1024     # what the socket's buffers hold before the daemon must keep the rest
HIGH_WATER = 64 * 1024      # asyncio's default: drain() waits above it
LOW_WATER = 16 * 1024
MAX_LINE = 64 * 1024


class _ToClient(asyncio.Transport):
    """The daemon's end of the server-to-client direction."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.protocol: asyncio.StreamReaderProtocol | None = None
        self._closing = False
        self._paused = False

    def write(self, data: Any) -> None:
        if self._closing:
            return
        if self.conn.hung_up:
            self.lost()  # EPIPE: the daemon learns of the hang-up when it writes
            return
        self.conn.pending += bytes(data)
        self.conn.readable.set()
        self.conn.high = max(self.conn.high, self.get_write_buffer_size())
        if not self._paused and self.get_write_buffer_size() > HIGH_WATER and self.protocol is not None:
            self._paused = True
            self.protocol.pause_writing()

    def flowed(self) -> None:
        """The client read: resume a paused writer once the buffer is low again."""
        if self._paused and self.get_write_buffer_size() <= LOW_WATER and self.protocol is not None:
            self._paused = False
            self.protocol.resume_writing()

    def get_write_buffer_size(self) -> int:
        return max(0, len(self.conn.pending) - KERNEL_BYTES)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return LOW_WATER, HIGH_WATER

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.conn.server_closed = True
        self.conn.readable.set()
        if self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.conn.pending.clear()
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        """The server's reader is full: the client's next write simply waits in memory."""

    def resume_reading(self) -> None:
        """See pause_reading."""

    def is_reading(self) -> bool:
        return True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Fixed limits."""

    def lost(self) -> None:
        """The connection is gone for the daemon: a write failed (EPIPE), or unsent bytes could not go."""
        if not self._closing:
            self._closing = True
            if self.protocol is not None:
                asyncio.get_running_loop().call_soon(self.protocol.connection_lost, BrokenPipeError(32, "Broken pipe"))


class Connection:
    """One client's connection to the daemon's socket."""

    def __init__(self) -> None:
        self.server_reader = asyncio.StreamReader(limit=MAX_LINE)
        self.transport = _ToClient(self)
        protocol = asyncio.StreamReaderProtocol(self.server_reader)
        protocol.connection_made(self.transport)
        self.transport.protocol = protocol
        self.server_writer = asyncio.StreamWriter(self.transport, protocol, self.server_reader,
                                                  asyncio.get_running_loop())
        self.pending = bytearray()
        self.readable = asyncio.Event()
        self.server_closed = False
        self.hung_up = False
        self.high = 0  # the most the daemon ever kept buffered for this client

    # -- the client's end --------------------------------------------------------------------

    def send(self, line: bytes) -> None:
        """Write a request line to the daemon."""
        if not self.hung_up and not self.server_reader.at_eof():
            self.server_reader.feed_data(line)

    async def readline(self) -> bytes:
        """Read the daemon's next line; b"" once it closed the connection (or it never comes)."""
        while True:
            if self.hung_up:
                return b""
            end = self.pending.find(b"\n")
            if end >= 0:
                line = bytes(self.pending[:end + 1])
                del self.pending[:end + 1]
                self.transport.flowed()
                return line
            if self.server_closed:
                return b""
            self.readable.clear()
            await self.readable.wait()

    def hang_up(self) -> None:
        """Close the client's end: the daemon reads EOF, and its writes fail."""
        if self.hung_up:
            return
        self.hung_up = True
        unsent = self.transport.get_write_buffer_size() > 0
        self.pending.clear()
        self.readable.set()
        if not self.server_reader.at_eof():
            self.server_reader.feed_eof()
        if unsent:  # what the daemon still holds cannot be sent: its writer fails now
            self.transport.lost()

    @property
    def open(self) -> bool:
        """Tell whether neither end has closed."""
        return not self.hung_up and not self.server_closed

    def buffered(self) -> int:
        """Return what the daemon keeps in its own memory for this client now."""
        return 0 if self.hung_up else self.transport.get_write_buffer_size()
