"""Acquire through a restart of gpuswapd: a lost connection is a pause, and the token gets the lease or place back.

gpuswapd answers an acquire first with its reclaim token (``{"event": "accepted", "token": ...}``).
When the connection drops while the request waits, or gpuswapd says it is stopping, the request
is sent again with ``"reclaim": token`` on a new connection: within gpuswapd's grace it gets its
lease back (a lease bound to its connection) or its place in the queue. A gpuswapd that does not
come back within the grace is unreachable (exit 3), as before.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from gpuswapd.ctl.client import Client, Unreachable
from gpuswapd.errors import Stopping

RECONNECT_FLOOR_S = 30.0  # a client keeps trying at least this long, whatever the grace
BACKOFF_S = (0.2, 2.0)  # between tries: first, cap

Event = Callable[[dict[str, Any]], None]


class Acquirer:
    """One acquire, sent again with its token after gpuswapd restarts."""

    def __init__(self, path: str, request: dict[str, Any], on_event: Event | None = None,
                 quiet: bool = False) -> None:
        self.path = path
        self.request = request
        self.on_event = on_event
        self.quiet = quiet
        self.token: str | None = None
        self.grace = RECONNECT_FLOOR_S
        self.reclaims = 0  # how many times it was sent again

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "accepted":
            token = event.get("token")
            self.token = token if isinstance(token, str) else self.token
            reclaim_s = event.get("reclaim_s")
            if isinstance(reclaim_s, (int, float)):
                self.grace = max(RECONNECT_FLOOR_S, float(reclaim_s))
            return
        if self.on_event is not None:
            self.on_event(event)

    def acquire(self) -> tuple[Client, dict[str, Any]]:
        """Send the acquire until it is answered; return the connection (kept open) and the reply."""
        lost_at: float | None = None
        tries = 0
        while True:
            try:
                client, reply = self._once()
            except (Unreachable, Stopping) as err:
                if self.token is None:
                    raise  # never accepted (or a gpuswapd without tokens): nothing to reclaim
                now = time.monotonic()
                lost_at = now if lost_at is None else lost_at
                if now - lost_at > self.grace:
                    raise
                if tries == 0:
                    self._say(f"gpuswapd went away while this request waited or held ({_why(err)}); sending it "
                              f"again with its token for up to {self.grace:g}s")
                tries += 1
                time.sleep(min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** min(tries - 1, 8)))
                continue
            if tries:
                self.reclaims += 1
                self._say("reconnected to gpuswapd: the request kept its lease or its place")
            return client, reply

    def _once(self) -> tuple[Client, dict[str, Any]]:
        client = Client(self.path)
        try:
            message = dict(self.request)
            if self.token is not None:
                message["reclaim"] = self.token
            # No read timeout: the window may take minutes to open; gpuswapd bounds it.
            return client, client.request(message, on_event=self._event, timeout=None)
        except BaseException:
            client.close()
            raise

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"gpuswapctl: {text}", file=sys.stderr, flush=True)


def _why(err: BaseException) -> str:
    return getattr(err, "message", None) or str(err)
