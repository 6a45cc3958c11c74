"""Who is on the other end of the socket, and whether a service is that caller's own.

Everything gpuswapd learns about a caller from the operating system goes through one ``Host``:
the socket's credentials as the kernel recorded them at connect() (``SO_PEERCRED``,
``SO_PEERGROUPS``), what /proc says of the process (trusted only while ``SO_PEERPIDFD``, or the
start time where the kernel has no pidfds, shows it is still the process that connected), what the
system manager says of a service (its cgroup, ``User=``, its main and control process), and the
names of users and groups. ``LinuxHost`` is the real one; the tests and the simulation hand the
server another.

The binding rule (docs/operating/systemd.md, "Who may ask"): a lease taken without ``--holder`` is bound to the
caller's system service only when that service is the caller's own:

- the system manager confirms the caller's cgroup is the service's (a cgroup made inside a
  service, or a user manager's, cannot pose as another one); and
- a caller other than root: the service runs as the caller's uid, by its ``User=`` or because
  its main process does;
- root: the caller is the service's main process or its control process (``ExecStartPre=``,
  ``ExecStopPost=``). A root job inside a service that runs jobs for many (cron, atd, sshd without
  pam_systemd, slurmd with proctrack/linuxproc) is not that service.

Any other caller's lease is bound to its uid. Only a bound lease ends with its unit, may be renewed
or released from it, and has its unit stopped by a preemption.
"""

from __future__ import annotations

import grp
import pwd
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpuswapd import clock
from gpuswapd.adapters import kernel
from gpuswapd.adapters.kernel import Process
from gpuswapd.adapters.unitnames import USER_MANAGER, owner_of
from gpuswapd.adapters.unitstates import ServiceProcesses
from gpuswapd.errors import GpuswapError, PermissionDenied
from gpuswapd.leases import Lease
from gpuswapd.logs import log
from gpuswapd.outside import Lane

if TYPE_CHECKING:  # the D-Bus adapter needs PyGObject, which tests of the logic do without
    from gpuswapd.adapters.systemd import Systemd


def passwd_name(uid: int) -> str:
    """Name a user from the password database (or give the uid)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(frozen=True)
class Peer:
    """A connected client process, as the kernel recorded it at connect()."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()  # its supplementary groups (SO_PEERGROUPS)
    unit: str | None = None  # a service of the system manager that is the caller's own (the binding rule)
    user_manager: bool = False  # the process runs under a user's own systemd (user@UID.service)
    started: int | None = None  # its start time when admitted, where the kernel has no pidfds
    origin: Any = field(default=None, compare=False, repr=False)  # what its Host looks at again (the socket)
    names: Callable[[int], str] = field(default=passwd_name, compare=False, repr=False)  # its Host's user_name

    @property
    def user(self) -> str:
        """Name the client's user (or its uid)."""
        return self.names(self.uid)

    @property
    def holder(self) -> str:
        """Name the default lease holder: the client's service, else its user and PID."""
        return self.unit if self.unit else f"{self.user}[{self.pid}]"

    def member(self, gid: int | None) -> bool:
        """Tell whether the client's primary or supplementary groups (at connect) include ``gid``."""
        return gid is not None and (gid == self.gid or gid in self.groups)

    def owns(self, lease: Lease) -> bool:
        """Tell whether this caller may renew or release ``lease``: its unit's, or its uid's."""
        if self.uid == 0:
            return True
        if lease.unit is not None:
            return lease.unit == self.unit
        return lease.uid == self.uid


class PeerChanged(Exception):
    """The process that connected is gone, or no longer what the kernel recorded at connect()."""


class Host(Protocol):
    """Everything gpuswapd asks the operating system about its callers.

    ``unit_cgroup``, ``unit_of_pid`` and ``service`` ask the system manager: they block, and
    the caller runs them on the systemd lane. The rest read the kernel's own tables.
    """

    def peer(self, sock: socket.socket) -> Peer:
        """Read who connected on ``sock`` (OSError if the kernel cannot say)."""

    def process(self, peer: Peer) -> Process | None:
        """Read the peer's process from /proc (None if hidden); PeerChanged if it is not the peer any more."""

    def still(self, peer: Peer) -> bool:
        """Tell whether the process that connected is still there (so its pid is still its own)."""

    def unit_cgroup(self, unit: str) -> str | None:
        """Ask the system manager for a loaded unit's cgroup (UnitNotFound if it has no such unit)."""

    def unit_of_pid(self, pid: int) -> str | None:
        """Ask the system manager which unit a process is in."""

    def service(self, unit: str) -> ServiceProcesses:
        """Ask the system manager whose a service's processes are."""

    def process_in(self, cgroup: str, pid: int) -> Process | None:
        """Find the process the manager calls ``pid`` among the members of ``cgroup`` (None if not there)."""

    def user_id(self, name: str) -> int | None:
        """Resolve a user name (or a uid written as a number); None if there is no such user."""

    def user_name(self, uid: int) -> str:
        """Name a user (or give the uid as text)."""

    def group_id(self, name: str) -> int | None:
        """Resolve a group name; None if there is no such group."""


class LinuxHost:
    """The real host: socket options, /proc, the cgroup tree, systemd over D-Bus, the user database."""

    def __init__(self, systemd: Systemd, proc: Path = Path("/proc"),
                 cgroups: tuple[Path, ...] = kernel.CGROUP_ROOTS) -> None:
        self.systemd = systemd
        self.proc = proc
        self.cgroups = cgroups
        self._pidfds: bool | None = None  # whether the kernel has SO_PEERPIDFD (learned from the first peer)

    def peer(self, sock: socket.socket) -> Peer:
        """Read SO_PEERCRED and SO_PEERGROUPS; where there are no pidfds, the process's start time too."""
        creds = kernel.credentials(sock)
        if self._pidfds is None:
            try:
                fd = kernel.peer_pidfd(sock)
            except OSError:
                fd = None  # this peer is gone already; the next one tells
            else:
                self._pidfds = fd is not None
            kernel.close(fd)
        started = None if self._pidfds else kernel.start_time(creds.pid, self.proc)
        return Peer(creds.pid, creds.uid, creds.gid, creds.groups, started=started, origin=sock,
                    names=self.user_name)

    def process(self, peer: Peer) -> Process | None:
        """Read the peer's process; check afterwards that it was the peer's all along."""
        try:
            found: Process | None = kernel.read_process(peer.pid, self.proc)
        except (OSError, ValueError, IndexError):
            found = None  # gone, or hidden (hidepid=): still() tells which
        if not self.still(peer):
            raise PeerChanged("has exited, and its pid may be another process's now")
        if found is not None and found.uid != peer.uid:
            raise PeerChanged(f"runs as uid {found.uid} now, not as the uid {peer.uid} it connected with")
        return found

    def still(self, peer: Peer) -> bool:
        """Ask the peer's pidfd whether it lives (else compare its start time with the one at admission)."""
        sock = peer.origin
        if isinstance(sock, socket.socket) and self._pidfds is not False:
            try:
                fd = kernel.peer_pidfd(sock)
            except OSError:
                return False  # a kernel that gives no pidfd of a process that has exited
            if fd is not None:
                try:
                    return kernel.pidfd_is(fd, peer.pid)
                finally:
                    kernel.close(fd)
        if peer.started is not None:
            return kernel.start_time(peer.pid, self.proc) == peer.started
        return True  # no pidfd and no start time (an old kernel, /proc hidden): nothing else to go by

    def unit_cgroup(self, unit: str) -> str | None:
        """Ask systemd for the unit's ControlGroup."""
        return self.systemd.control_group(unit)

    def unit_of_pid(self, pid: int) -> str | None:
        """Ask systemd which of its units owns the process (a user manager's user@UID.service included)."""
        owner = self.systemd.owner_of_pid(pid)
        return None if owner is None else owner.unit

    def service(self, unit: str) -> ServiceProcesses:
        """Ask systemd for the service's User=, DynamicUser=, MainPID and ControlPID."""
        return self.systemd.service_processes(unit)

    def process_in(self, cgroup: str, pid: int) -> Process | None:
        """Find the manager's ``pid`` in ``cgroup``, whichever PID namespace the manager numbers it in.

        The manager may number processes in a namespace of its own (a container's, the test
        world's): of the cgroup's members, the one whose innermost pid is ``pid`` in the shallowest
        namespace is the manager's (every member lives in the manager's namespace or below it).
        """
        try:
            same = kernel.read_process(pid, self.proc)
        except (OSError, ValueError, IndexError):
            same = None
        if same is not None and same.cgroup == cgroup and len(same.nspid) == 1:
            return same  # the manager numbers processes as gpuswapd does
        best: Process | None = None
        for member in kernel.cgroup_members(cgroup, self.cgroups):
            try:
                found = kernel.read_process(member, self.proc)
            except (OSError, ValueError, IndexError):
                continue
            if found.nspid[-1] == pid and found.cgroup == cgroup and (best is None or
                                                                       len(found.nspid) < len(best.nspid)):
                best = found
        return best

    def user_id(self, name: str) -> int | None:
        """Resolve ``User=`` as systemd does: a uid as a number, else a name."""
        if name.isdigit():
            return int(name)
        try:
            return pwd.getpwnam(name).pw_uid
        except KeyError:
            return None

    def user_name(self, uid: int) -> str:
        """Name a user from the password database."""
        return passwd_name(uid)

    def group_id(self, name: str) -> int | None:
        """Resolve a group name from the group database."""
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            return None


async def identify(peer: Peer, host: Host, lane: Lane) -> Peer:
    """Find the caller's own service of the system manager (the binding rule), trusting only what it confirms.

    A caller whose process is gone or changed is refused (PermissionDenied) and logged: what
    /proc says under its pid may be another process's.
    """
    try:
        process = host.process(peer)
    except PeerChanged as err:
        raise _refused(peer, str(err)) from None
    if process is None:  # /proc hides it (hidepid=): systemd says which unit the pid is in
        try:
            unit = await lane.call("unit_of_pid", host.unit_of_pid, peer.pid)
        except GpuswapError:
            return peer
        if not host.still(peer):
            raise _refused(peer, "has exited, and its pid may be another process's now")
        if unit is None or not unit.endswith(".service"):
            return peer
        if USER_MANAGER.match(unit):
            return replace(peer, user_manager=True)
        try:
            group = await lane.call("unit_cgroup", host.unit_cgroup, unit)
        except GpuswapError:
            return peer
        return await _bind(peer, unit, group, host, lane)
    # One attribution for callers and for the card's processes (unitnames.owner_of), run as one call
    # on the systemd lane; what the manager confirmed is kept, per host, by cgroup path.
    try:
        owner = await lane.call("unit_cgroup", owner_of, process.cgroup or "/", host.unit_cgroup, _known(host))
    except GpuswapError:
        return peer  # systemd cannot say now: a lease bound to the uid is the safe answer
    if owner.unit is None or not owner.unit.endswith(".service"):
        return peer
    if owner.user_manager:
        return replace(peer, user_manager=True)
    return await _bind(peer, owner.unit, owner.cgroup, host, lane)


NAME_FRESH_S = 60.0  # a user name looked up is used this long (a renamed user shows within a minute)
_NAMES: weakref.WeakKeyDictionary[Host, dict[int, tuple[str, float]]] = weakref.WeakKeyDictionary()


async def named(peer: Peer, host: Host, lane: Lane) -> Peer:
    """Give the peer its user's name, looked up on the lane (the user database may be LDAP or sssd).

    Never on the event loop: a name is used in holders and messages, and a lookup that blocks
    would stop every client. Looked up at most once a minute per uid; the uid stands in for a name
    the lookup could not give.
    """
    names = _NAMES.setdefault(host, {})
    known = names.get(peer.uid)
    if known is None or clock.monotonic() - known[1] > NAME_FRESH_S:
        try:
            name = await lane.call("user_name", host.user_name, peer.uid)
        except GpuswapError:
            name = str(peer.uid)
        if len(names) > 4096:
            names.clear()  # uids come from the kernel: bounded all the same
        known = names[peer.uid] = (name, clock.monotonic())
    return replace(peer, names=_Named(known[0]))


@dataclass(frozen=True)
class _Named:
    """A user name looked up once: what ``Peer.names`` answers from then on."""

    name: str

    def __call__(self, uid: int) -> str:
        return self.name


_KNOWN: weakref.WeakKeyDictionary[Host, dict[str, str]] = weakref.WeakKeyDictionary()


def _known(host: Host) -> dict[str, str]:
    """Return the cgroups the host's system manager has confirmed are a unit's (by path)."""
    return _KNOWN.setdefault(host, {})


async def _bind(peer: Peer, unit: str, group: str | None, host: Host, lane: Lane) -> Peer:
    """Bind the peer to ``unit`` if the unit is its own; else leave it bound to its uid."""
    if group is None:
        return peer
    try:
        # On the lane as one call: the manager's answer, and User= resolved in the user database
        # (LDAP or sssd can block: never on the event loop).
        service, owns = await lane.call("unit_service", _service_owned, peer, unit, group, host)
    except GpuswapError:
        return peer  # systemd cannot say now: a lease bound to the uid is the safe answer
    if owns:
        return replace(peer, unit=unit)
    log.debug("peer_not_the_unit", pid=peer.pid, uid=peer.uid, unit=unit, unit_user=service.user)
    return peer


def _service_owned(peer: Peer, unit: str, group: str, host: Host) -> tuple[ServiceProcesses, bool]:
    """Ask the manager whose ``unit``'s processes are, and apply the binding rule (blocks: run on the lane)."""
    service = host.service(unit)
    return service, owns_service(peer, service, group, host)


def owns_service(peer: Peer, service: ServiceProcesses, group: str, host: Host) -> bool:
    """Apply the binding rule to a caller inside ``service`` (whose cgroup is ``group``)."""
    if peer.uid == 0:
        # Root's own service is one whose main or control process is the caller itself: a root job
        # that cron, atd, sshd or slurmd runs for someone is a child of their main process.
        for pid in (service.main_pid, service.control_pid):
            found = host.process_in(group, pid) if pid else None
            if found is not None and found.pid == peer.pid:
                return True
        return False
    if service.user and host.user_id(service.user) == peer.uid:
        return True
    main = host.process_in(group, service.main_pid) if service.main_pid else None
    return main is not None and main.uid == peer.uid


def _refused(peer: Peer, why: str) -> PermissionDenied:
    log.warning("peer_mismatch", pid=peer.pid, uid=peer.uid, reason=why)
    return PermissionDenied(f"the process that connected (pid {peer.pid}, uid {peer.uid}) {why}: gpuswapd cannot "
                            "tell which unit it runs in, so it refuses; ask again from a process that waits for "
                            "its answer")
