"""What the kernel says of a socket's peer and of a process: socket options, /proc, a cgroup's members.

The peer's credentials come from the socket, as they were at connect(): ``SO_PEERCRED`` (pid, uid,
gid) and ``SO_PEERGROUPS`` (its supplementary groups). Anything read later by pid from /proc may
belong to another process if the peer has exited and its pid was reused; ``SO_PEERPIDFD`` (Linux
6.5) gives a pidfd of the process that connected, which tells whether it is still that process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from gpuswapd.adapters.unitnames import cgroup_of

# <asm-generic/socket.h>: Python's socket module has no constants for these two.
SO_PEERGROUPS = 59
SO_PEERPIDFD = 77
_GROUPS_FIRST = 64  # supplementary groups read at first; ERANGE says how many more there are
NGROUPS_MAX = 65536
_NO_OPTION = frozenset({errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP})
CGROUP_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"))


@dataclass(frozen=True)
class Credentials:
    """Who connected, as the kernel recorded it at connect()."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


@dataclass(frozen=True)
class Process:
    """What /proc says of a process now."""

    pid: int                  # in gpuswapd's PID namespace
    uid: int                  # effective
    nspid: tuple[int, ...]    # its pid in each PID namespace, from gpuswapd's down to its own
    started: int              # clock ticks after boot: a reused pid has a later one
    cgroup: str | None


def credentials(sock: socket.socket) -> Credentials:
    """Read the peer's pid, uid, gid and supplementary groups from a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Credentials(pid, uid, gid, frozenset(peer_groups(sock)))


def peer_groups(sock: socket.socket) -> list[int]:
    """Read the peer's supplementary groups as they were at connect() (SO_PEERGROUPS)."""
    size = _GROUPS_FIRST
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size * 4)
        except OSError as err:
            if err.errno == errno.ERANGE and size < NGROUPS_MAX:
                size = NGROUPS_MAX
                continue
            raise
        return list(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def peer_pidfd(sock: socket.socket) -> int | None:
    """Open a pidfd of the process that connected (SO_PEERPIDFD); None where the kernel has none."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError as err:
        if err.errno in _NO_OPTION:
            return None
        raise


def pidfd_is(fd: int, pid: int) -> bool:
    """Tell whether a pidfd's process is ``pid`` and has not exited (so the pid is not reused)."""
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        if line.startswith("Pid:") and line.split()[1:] != [str(pid)]:
            return False  # another process, or -1: it has exited
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return not poller.poll(0)  # a pidfd turns readable when its process exits


def read_process(pid: int, proc: Path = Path("/proc")) -> Process:
    """Read a process's effective uid, pids, start time and cgroup (OSError or ValueError if it cannot be read)."""
    status = (proc / str(pid) / "status").read_text()
    stat = (proc / str(pid) / "stat").read_text()
    uid, nspid = -1, tuple[int, ...]((pid,))
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[2])
        elif line.startswith("NSpid:"):
            nspid = tuple(int(n) for n in line.split()[1:])
    if uid < 0:
        raise ValueError(f"/proc/{pid}/status has no Uid: line")
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    started = int(stat[stat.rindex(")") + 2:].split()[19])
    return Process(pid, uid, nspid, started, cgroup_of(pid, proc))


def start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Read when a process started (clock ticks after boot); None if /proc does not say."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def cgroup_members(cgroup: str, roots: tuple[Path, ...] = CGROUP_ROOTS) -> list[int]:
    """List the pids in one cgroup (not its children), in every hierarchy that has it (v2, hybrid, v1)."""
    found: set[int] = set()
    for root in roots:
        with contextlib.suppress(OSError, ValueError):
            found.update(int(line) for line in (root / cgroup.lstrip("/") / "cgroup.procs").read_text().split())
    return sorted(found)


def close(fd: int | None) -> None:
    """Close a descriptor, if there is one."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
