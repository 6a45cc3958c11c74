"""Who is on the other end of the socket: SO_PEERCRED, the process's unit, its groups, what it owns."""

from __future__ import annotations

import grp
import pwd
import re
import socket
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuswapd.adapters.unitnames import cgroup_of, service_prefixes
from gpuswapd.errors import GpuswapError, UnitNotFound
from gpuswapd.leases import Lease
from gpuswapd.outside import Lane

USER_MANAGER = re.compile(r"^user@\d+\.service$")

if TYPE_CHECKING:  # the D-Bus adapter needs PyGObject, which tests of the logic do without
    from gpuswapd.adapters.systemd import Systemd


@dataclass(frozen=True)
class Peer:
    """A connected client process."""

    pid: int
    uid: int
    gid: int
    unit: str | None = None  # a service of the system manager, confirmed by it
    user_manager: bool = False  # the process runs under a user's own systemd (user@UID.service)

    @property
    def user(self) -> str:
        """Name the client's user (or its uid)."""
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    @property
    def holder(self) -> str:
        """Name the default lease holder: the client's service, else its user and PID."""
        return self.unit if self.unit else f"{self.user}[{self.pid}]"

    def in_group(self, group: str) -> bool:
        """Tell whether the client's primary or supplementary groups include ``group``."""
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            return False
        return gid == self.gid or gid in _supplementary_groups(self.pid)

    def owns(self, lease: Lease) -> bool:
        """Tell whether this caller may renew or release ``lease``: its unit's, or its uid's."""
        if self.uid == 0:
            return True
        if lease.unit is not None:
            return lease.unit == self.unit
        return lease.uid == self.uid


def credentials(sock: socket.socket) -> Peer:
    """Read the peer's PID, UID and GID from a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


async def identify(peer: Peer, systemd: Systemd, lane: Lane) -> Peer:
    """Find the peer's service of the system manager, trusting only what that manager confirms."""
    try:
        cgroup = cgroup_of(peer.pid)
    except OSError:
        cgroup = None  # /proc hides it (hidepid=): systemd says which unit the PID is in
        try:
            unit = await lane.call("unit_of_pid", systemd.unit_of_pid, peer.pid)
        except GpuswapError:
            return peer
        if unit is None or not unit.endswith(".service"):
            return peer
        return replace(peer, user_manager=True) if USER_MANAGER.match(unit) else replace(peer, unit=unit)
    for unit, upto in service_prefixes(cgroup or ""):
        try:
            group = await lane.call("unit_cgroup", systemd.control_group, unit)
        except UnitNotFound:
            continue
        except GpuswapError:
            return peer  # systemd cannot say now: a lease bound to the uid is the safe answer
        if group != upto:
            continue  # a cgroup that only looks like this unit's (made inside another one)
        if USER_MANAGER.match(unit):
            return replace(peer, user_manager=True)
        return replace(peer, unit=unit)
    return peer


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()
