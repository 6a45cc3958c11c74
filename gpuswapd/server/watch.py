"""``gpuswapctl watch``: the events, one JSON line each, for as long as the client reads them.

A watcher is never waited for. Each event is written to its connection's buffer at once; a
watcher whose buffer holds more than ``MAX_BUFFERED`` bytes (it does not read, or reads too
slowly) is dropped: its connection is cut and it gets nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib

from gpuswapd.events import Event, EventBus
from gpuswapd.logs import log
from gpuswapd.protocol import encode
from gpuswapd.tasks import retrieve

MAX_BUFFERED = 256 * 1024  # a few thousand events: a reader that keeps up never comes near it


class Watchers:
    """Serves the watch subscriptions of one daemon."""

    def __init__(self, bus: EventBus, max_buffered: int = MAX_BUFFERED) -> None:
        self.bus = bus
        self.max_buffered = max_buffered
        self.dropped = 0

    async def serve(self, who: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Stream events to a client until it hangs up or falls behind."""
        gone = asyncio.Event()

        def deliver(event: Event) -> None:
            if writer.is_closing():
                gone.set()
                return
            if writer.transport.get_write_buffer_size() > self.max_buffered:
                self.dropped += 1
                writer.transport.abort()
                gone.set()
                log.warning("watcher_dropped", watcher=who, reason=f"it left more than {self.max_buffered} bytes "
                            "of events unread")
                return
            writer.write(encode(event))

        deliver({"event": "subscribed"})
        unsubscribe = self.bus.subscribe(deliver)
        # The client sends nothing; EOF means it went away.
        hangup = asyncio.ensure_future(_until_eof(reader))
        retrieve(hangup)
        stop = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({hangup, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            unsubscribe()
            hangup.cancel()
            stop.cancel()


async def _until_eof(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(4096):
            pass
