"""The benchmarks' clients of gpuswapd: connections opened before the timed span, and a running watch.

Every variant of a benchmark is timed from the same kind of client: a connection to gpuswapd's
socket that is already open when the clock starts (no interpreter start-up, no ``gpuswapctl``
process), and the end of a close is the ``window_finished`` event as a running ``watch``
subscription receives it, not a status poll with sleeps between. What a fresh ``gpuswapctl``
adds on top (its start-up) is measured apart (``cli_startup``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuswapd.ctl.client import Client
from tests.stack.world import StackError

Event = dict[str, Any]


class Events:
    """A running ``watch`` subscription: every event gpuswapd sends, stamped with when it arrived here."""

    def __init__(self, socket: Path) -> None:
        self._client = Client(str(socket))
        self._stream = self._client.watch()
        first = next(self._stream)
        if first.get("event") != "subscribed":
            raise StackError(f"watch began with {first}, not 'subscribed'")
        self._queue: queue.Queue[tuple[float, Event]] = queue.Queue()
        self._thread = threading.Thread(target=self._read, name="bench-watch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self._queue.put((time.monotonic(), event))
        except Exception as err:
            self._queue.put((time.monotonic(), {"event": "_lost", "error": repr(err)}))

    def clear(self) -> None:
        """Forget the events received so far (those of an earlier step)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def wait_for(self, what: str, match: Callable[[Event], bool], timeout: float = 180) -> tuple[float, Event]:
        """Block until an event matches; return when it arrived (time.monotonic()) and the event."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                at, event = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise StackError(f"no {what} within {timeout:g}s") from None
            if event["event"] == "_lost":
                raise StackError(f"the watch ended while waiting for {what}: {event['error']}")
            if event["event"] == "window_failed":
                raise StackError(f"a window failed while waiting for {what}: {event}")
            if match(event):
                return at, event

    def finished(self, window: str | None = None, timeout: float = 180) -> tuple[float, Event]:
        """Wait for ``window_finished`` (of ``window``, if given)."""
        return self.wait_for(f"window_finished of {window or 'a window'}",
                             lambda e: e["event"] == "window_finished" and window in (None, e.get("window")),
                             timeout)

    def close(self) -> None:
        """End the subscription."""
        self._client.close()
        self._thread.join(5)


class Ready:
    """A connection opened before the clock starts, for one request."""

    def __init__(self, socket: Path) -> None:
        self._client = Client(str(socket))

    def send(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Send the request; return when its final reply arrived (time.monotonic()) and the reply."""
        try:
            reply = self._client.request(message, timeout=None)
            return time.monotonic(), reply
        finally:
            self._client.close()


def acquire(holder: str, profile: str = "default", seconds: int = 600) -> dict[str, Any]:
    """An acquire request that waits until the window is READY."""
    return {"op": "acquire", "for": seconds, "holder": holder, "profile": profile}


def release(holder: str) -> dict[str, Any]:
    """A release of every lease of ``holder`` (held by this uid)."""
    return {"op": "release", "holder": holder}


class Later:
    """A request sent now by a running client in a thread of its own; its reply is awaited later."""

    def __init__(self, socket: Path, message: dict[str, Any]) -> None:
        self._ready = Ready(socket)
        self.at: float | None = None
        self.reply: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._send, args=(message,), name="bench-later", daemon=True)
        self._thread.start()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.at, self.reply = self._ready.send(message)
        except BaseException as err:
            self.error = err

    def result(self, timeout: float = 180) -> tuple[float, dict[str, Any]]:
        """Wait for the reply; return when it arrived and the reply."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise StackError(f"no reply within {timeout:g}s")
        if self.error is not None:
            raise StackError(f"the request failed: {self.error}") from self.error
        assert self.at is not None and self.reply is not None
        return self.at, self.reply
