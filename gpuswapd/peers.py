"""Who is on the other end of the socket: SO_PEERCRED, the process's unit, its groups."""

from __future__ import annotations

import grp
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Peer:
    """A connected client process."""

    pid: int
    uid: int
    gid: int
    unit: str | None = None

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


def credentials(sock: socket.socket) -> Peer:
    """Read the peer's PID, UID and GID from a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()
