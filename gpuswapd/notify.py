"""sd_notify(3) without libsystemd: READY=1, STATUS=, WATCHDOG=1, STOPPING=1."""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends notifications to systemd when it asked for them (``$NOTIFY_SOCKET``)."""

    def __init__(self, address: str | None = None) -> None:
        addr = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # An abstract socket is written with a leading "@".
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """Tell whether systemd listens."""
        return bool(self._addr)

    def send(self, **fields: str) -> None:
        """Send ``KEY=value`` lines; errors are ignored, as in sd_notify(3)."""
        if not self._addr:
            return
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self._addr)
        except OSError:
            pass

    def watchdog_interval(self) -> float | None:
        """Return how often to send WATCHDOG=1 (half of WatchdogSec=), if systemd wants it."""
        usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2e6
        except ValueError:
            return None
