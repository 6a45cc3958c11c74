"""Connection caps, counted so that no one can starve the people in charge.

Every non-root user may hold ``max_clients_per_uid`` connections at once. Of ``max_clients``
in all, the last ``reserved_clients`` are kept for root and members of ``socket_group``: a flood
from one user, or from many, leaves the operator's ``gpuswapctl status`` an answer. A refused
connection gets one line saying why and is closed at once, so the daemon never holds more
descriptors than the caps allow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from gpuswapd import clock
from gpuswapd.logs import log
from gpuswapd.server.peers import Peer

LOG_EVERY_S = 60.0  # a flood is logged once a minute per user, with a count, not once a connection


class Admission:
    """Counts the open connections per uid and in all; says who may not have another."""

    def __init__(self, max_clients: int, per_uid: int, reserved: int, privileged: Callable[[Peer], bool]) -> None:
        self.max_clients = max_clients
        self.per_uid = per_uid
        self.reserved = min(reserved, max_clients)
        self._privileged = privileged
        self._open: Counter[int] = Counter()
        self._total = 0
        self._refused: Counter[int] = Counter()
        self._logged_at: dict[int, float] = {}

    @property
    def open(self) -> int:
        """Count the connections admitted and not yet closed."""
        return self._total

    def admit(self, peer: Peer) -> str | None:
        """Count a new connection in; return why it is refused instead, if it is."""
        reason = self._refusal(peer)
        if reason is not None:
            self._note_refusal(peer, reason)
            return reason
        self._open[peer.uid] += 1
        self._total += 1
        return None

    def leave(self, peer: Peer) -> None:
        """Count a closed connection out."""
        self._open[peer.uid] -= 1
        if self._open[peer.uid] <= 0:
            del self._open[peer.uid]
        self._total -= 1

    def _refusal(self, peer: Peer) -> str | None:
        if peer.uid != 0 and self._open[peer.uid] >= self.per_uid:
            return (f"user {peer.user} (uid {peer.uid}) already has {self._open[peer.uid]} connections open to "
                    f"gpuswapd (daemon.max_clients_per_uid = {self.per_uid}); close some and try again")
        privileged = peer.uid == 0 or self._privileged(peer)
        limit = self.max_clients if privileged else self.max_clients - self.reserved
        if self._total >= limit:
            whom = "" if privileged else f" ({self.reserved} of daemon.max_clients are kept for root and the group)"
            return (f"gpuswapd is serving {self._total} connections, its limit{whom}; "
                    f"try again shortly")
        return None

    def _note_refusal(self, peer: Peer, reason: str) -> None:
        self._refused[peer.uid] += 1
        now = clock.monotonic()
        if now - self._logged_at.get(peer.uid, -LOG_EVERY_S) >= LOG_EVERY_S:
            log.warning("clients_refused", uid=peer.uid, refused=self._refused[peer.uid], reason=reason)
            self._logged_at[peer.uid] = now
            self._refused[peer.uid] = 0
