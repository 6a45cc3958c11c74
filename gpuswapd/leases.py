"""Leases on the GPU window: who holds it, until when. Pure logic; the caller owns the clock.

A lease's times are the daemon's (``clock.now``: a wall step moves none); what it says of itself
to the wire and the state document is in wall-clock time (``clock.to_wall``), what it reads back
is turned into the daemon's again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuswapd import clock, ids
from gpuswapd.errors import LeaseNotFound


@dataclass
class Lease:
    """One holder's claim on the open window."""

    id: str
    holder: str
    granted_at: float
    expires_at: float
    unit: str | None = None
    uid: int | None = None
    priority: int = 0
    bound: bool = False  # bound to its acquire's connection: it ends when that connection does
    token: str | None = None  # the hash of its client's reclaim token (protocol.token_hash)
    reclaim_by: float | None = None  # bound, and its connection gone with a gpuswapd: it ends then, unless reclaimed
    # Not kept on disk: while a renewal's write is under way, the expiry last recorded (it ends no sooner).
    recorded_until: float | None = field(default=None, compare=False, repr=False)

    def ends_at(self) -> float:
        """Return when it ends: its expiry, but no sooner than the one on disk while a renewal is recorded."""
        return self.expires_at if self.recorded_until is None else max(self.expires_at, self.recorded_until)

    def remaining(self, now: float) -> float:
        """Return the seconds left, never negative."""
        return max(0.0, self.expires_at - now)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """Serialize; with ``now``, include the seconds remaining."""
        expires_at = clock.to_wall(self.expires_at) if math.isfinite(self.expires_at) else None  # null: until released
        out: dict[str, Any] = {"id": self.id, "holder": self.holder, "granted_at": clock.to_wall(self.granted_at),
                               "expires_at": expires_at, "unit": self.unit, "uid": self.uid,
                               "priority": self.priority, "bind": "connection" if self.bound else None}
        if self.token is not None:
            out["token"] = self.token
        if self.reclaim_by is not None:
            out["reclaim_by"] = clock.to_wall(self.reclaim_by)
        if now is not None:
            left = self.remaining(now)
            out["remaining_s"] = round(left, 3) if math.isfinite(left) else None  # null: until released
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        """Rebuild a lease from ``to_dict`` output."""
        return cls(str(data["id"]), str(data["holder"]), clock.from_wall(float(data["granted_at"])),
                   clock.from_wall(_expiry(data["expires_at"])), data.get("unit"), data.get("uid"),
                   int(data.get("priority") or 0), data.get("bind") == "connection", _hex(data.get("token")),
                   _from_wall(_when(data.get("reclaim_by"))))


def _from_wall(value: float | None) -> float | None:
    return None if value is None else clock.from_wall(value)


def _hex(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _when(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _expiry(value: Any) -> float:
    """Read an expiry; null is a lease for infinity."""
    return math.inf if value is None else float(value)


class LeaseBook:
    """The leases of the current window."""

    def __init__(self, leases: list[Lease] | None = None) -> None:
        self._leases: dict[str, Lease] = {lease.id: lease for lease in leases or []}

    def __len__(self) -> int:
        return len(self._leases)

    def all(self) -> list[Lease]:
        """List the leases, oldest first."""
        return sorted(self._leases.values(), key=lambda lease: lease.granted_at)

    def grant(self, holder: str, duration: float, now: float, unit: str | None = None,
              uid: int | None = None, priority: int = 0, bound: bool = False, token: str | None = None) -> Lease:
        """Grant a new lease of ``duration`` seconds from ``now``."""
        lease = Lease(ids.token(6), holder, now, now + duration, unit, uid, priority, bound, token)
        self._leases[lease.id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        """Find a lease by id."""
        try:
            return self._leases[lease_id]
        except KeyError:
            raise LeaseNotFound(f"no lease {lease_id!r} (it may have expired or been released)") from None

    def renew(self, lease_id: str, duration: float, now: float) -> Lease:
        """Extend a lease to end ``duration`` seconds from ``now``."""
        lease = self.get(lease_id)
        lease.expires_at = now + duration
        return lease

    def release(self, lease_id: str) -> Lease:
        """End one lease."""
        lease = self.get(lease_id)
        del self._leases[lease_id]
        return lease

    def matching(self, match: Callable[[Lease], bool]) -> list[Lease]:
        """List the leases ``match`` accepts."""
        return [lease for lease in self.all() if match(lease)]

    def expire(self, now: float) -> list[Lease]:
        """Remove and return the leases that have run out, or were not reclaimed within their grace."""
        gone = [lease for lease in self._leases.values() if lease.ends_at() <= now
                or (lease.reclaim_by is not None and lease.reclaim_by <= now)]
        for lease in gone:
            del self._leases[lease.id]
        return gone

    def next_expiry(self) -> float | None:
        """Return when the next lease runs out, if any."""
        return min((min(lease.ends_at(), lease.reclaim_by if lease.reclaim_by is not None else math.inf)
                    for lease in self._leases.values()), default=None)

    def by_token(self, token: str) -> Lease | None:
        """Find the lease of a reclaim token's hash, if any."""
        return next((lease for lease in self._leases.values() if lease.token == token), None)

    def clear(self) -> list[Lease]:
        """End every lease; return them."""
        gone = self.all()
        self._leases.clear()
        return gone
