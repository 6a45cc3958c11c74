"""The Unix socket server: admits within the caps, validates each request, checks who asks, answers.

It never dies of a client: a refused, malformed, slow or vanished client gets a clear answer (or
none, if it is gone) and every other client goes on being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gpuswapd import __version__, clock, ids
from gpuswapd.config import Config, Profile
from gpuswapd.errors import (
    AcquireTimeout,
    GpuswapError,
    LeaseNotFound,
    PermissionDenied,
    RequestError,
    TooManyClients,
    UnknownProfile,
)
from gpuswapd.leases import Lease
from gpuswapd.logs import log
from gpuswapd.outside import Outside
from gpuswapd.protocol import MAX_LINE, JsonObject, Request, encode, error_reply, parse_request, token_hash
from gpuswapd.retry import backoff
from gpuswapd.server.admission import Admission
from gpuswapd.server.clients import Clients
from gpuswapd.server.peers import Host, LinuxHost, Peer, identify, named
from gpuswapd.server.watch import MAX_BUFFERED, Watchers
from gpuswapd.sizes import format_size
from gpuswapd.state.store import StateStore
from gpuswapd.tasks import reap, retrieve, spawn
from gpuswapd.timespan import format_span
from gpuswapd.window.plan import Plan
from gpuswapd.window.window import Window

FIRST_REQUEST_S = 10.0   # a client that connects and says nothing is dropped after this
IDLE_S = 60.0            # between requests on one connection
WRITE_S = 10.0           # a client that does not read its replies is dropped after this
READ_ONLY = frozenset({"status", "history", "watch"})
BACKLOG = 1024
NAMES_S = 10.0  # the user and group databases (files, LDAP, sssd) answer within this, or are taken as silent
# accept() fails with these when the process or the system is out of descriptors or memory:
# wait a little (never spin), and let the caps bring the count down.
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = (0.05, 1.0)
ACCEPT_BATCH = 16  # connections taken per turn of the event loop: a burst costs few turns; more makes turns long

if TYPE_CHECKING:  # the D-Bus adapter needs PyGObject, which tests of the logic do without
    from gpuswapd.adapters.systemd import Systemd


class Server:
    """Serves the socket protocol for one window."""

    def __init__(self, config: Config, window: Window, store: StateStore, units: Systemd, outside: Outside,
                 planner: Callable[[str], Awaitable[Plan]], instance: str = "default",
                 host: Host | None = None) -> None:
        self.config = config
        # Everything learnt of a caller from the OS: its credentials, its process, its unit's owner.
        self.host: Host = host if host is not None else LinuxHost(units)
        self.instance = instance
        self.window = window
        self.store = store
        self.units = units
        self.outside = outside
        self.planner = planner
        self.started_at = clock.now()
        d = config.daemon
        self.admission = Admission(d.max_clients, d.max_clients_per_uid, d.reserved_clients, self._in_group)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._clients = Clients(self.admission)
        self.watchers: Watchers | None = None  # gpuswapctl watch; the daemon sets it
        self.max_buffered = MAX_BUFFERED  # what one client may leave unread before it is dropped
        self._group_gid: int | None = None  # socket_group's gid, resolved off the loop at start
        self._group_known = False

    def _in_group(self, peer: Peer) -> bool:
        """Tell whether the caller was in ``socket_group`` when it connected (SO_PEERGROUPS, not /proc)."""
        group = self.config.daemon.socket_group
        if not group:
            return False
        if not self._group_known:  # not started on a socket (the simulation's streams): its host is in memory
            self._group_gid, self._group_known = self.host.group_id(group), True
        return peer.member(self._group_gid)

    async def _resolve_group(self) -> None:
        """Resolve ``socket_group`` once, on a thread: the group database may be LDAP or sssd, which can block."""
        group = self.config.daemon.socket_group
        if not group:
            return
        try:
            self._group_gid = await asyncio.wait_for(asyncio.to_thread(self.host.group_id, group), NAMES_S)
            self._group_known = True
        except TimeoutError:
            self._group_gid = None
            self._group_known = True
            log.error("socket_group_unresolved", group=group, waited_s=NAMES_S,
                      consequence="only root is served until gpuswapd restarts; check nsswitch (LDAP, sssd)")

    async def start(self, sock: socket.socket) -> None:
        """Serve on a listening socket (our own, or one systemd handed over)."""
        await self._resolve_group()
        # A burst of clients must queue in the kernel, not be refused: listen() again with more room.
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = spawn(self._accept_loop(sock), "accept")

    async def close(self) -> None:
        """Stop accepting and drop the connected clients."""
        await reap(self._accepting)
        await self._clients.drop()

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as err:
                if err.errno not in _OUT_OF_RESOURCES:
                    raise
                failures += 1
                delay = backoff(ACCEPT_BACKOFF_S, failures)
                log.error("accept_out_of_resources", error=err.strerror, open=self.admission.open, retry_in_s=delay)
                await asyncio.sleep(delay)
                continue
            failures = 0
            for accepted in [conn, *_pending(sock, ACCEPT_BATCH - 1)]:
                self._admit(accepted)
            # sock_accept does not yield while connections are pending: let the clients already
            # admitted run, or a flood of new ones would starve them (and the window).
            await asyncio.sleep(0)

    def _admit(self, conn: socket.socket) -> None:
        """Serve an accepted connection, or refuse it over the caps."""
        try:
            peer = self.host.peer(conn)
        except OSError:
            conn.close()
            return
        refusal = self.admission.admit(peer)
        if refusal is not None:
            _refuse(conn, refusal)
            return
        self._clients.track(spawn(self._handle(conn, peer), "client"))

    def serve_streams(self, peer: Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
        """Serve a connection given as streams (the simulation's), unless the caps refuse it; say why if so."""
        refusal = self.admission.admit(peer)
        if refusal is not None:
            writer.write(encode(error_reply(TooManyClients(refusal))))
            writer.close()
            return refusal
        self._clients.track(spawn(self.serve_connection(peer, reader, writer), "client"))
        return None

    async def _handle(self, conn: socket.socket, peer: Peer) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=MAX_LINE)
        except BaseException as err:
            self.admission.leave(peer)
            conn.close()
            if not isinstance(err, Exception):
                raise
            log.debug("client_dropped", error=repr(err))
            return
        await self.serve_connection(peer, reader, writer)

    async def serve_connection(self, peer: Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one admitted client's requests until it hangs up (the simulation's streams too)."""
        async with self._clients.serving(peer, writer):
            try:
                await self._serve(peer, reader, writer)
            except (ConnectionError, TimeoutError, asyncio.IncompleteReadError) as err:
                log.debug("client_dropped", error=repr(err))
            except asyncio.CancelledError:
                pass
            except Exception:  # a bug must not take the daemon down with one client
                log.exception("client_handler_crashed")

    async def _identify(self, peer: Peer) -> Peer:
        """Find the peer's service, for the requests that need it (a lease without --holder, ownership)."""
        return await identify(peer, self.host, self.outside.systemd)

    async def _serve(self, peer: Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = await named(peer, self.host, self.outside.systemd)
        wait = FIRST_REQUEST_S
        while True:
            try:
                async with asyncio.timeout(wait):
                    line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                await self._send(writer, error_reply(RequestError(f"request line longer than {MAX_LINE} bytes")))
                return
            except TimeoutError:
                await self._send(writer, error_reply(RequestError(f"no request within {wait:g}s")))
                return
            if not line:
                return
            if not line.endswith(b"\n"):
                return  # the client hung up mid-line
            wait = IDLE_S
            try:
                request = parse_request(line)
                self._authorize(peer, request)
                reply = await self._dispatch(peer, request, reader, writer)
            except GpuswapError as err:
                reply = error_reply(err)
            except ConnectionError:
                raise  # the client went away while gpuswapd wrote to it (an event, a reclaim's answer): no bug
            except Exception as err:  # a bug: answer, log, and keep serving everyone else
                log.exception("request_crashed", request=line[:200].decode(errors="replace"))
                reply = error_reply(GpuswapError(f"gpuswapd failed on this request ({type(err).__name__}); "
                                                 "see its log (journalctl -u gpuswapd)"))
            if reply is None:  # answered already, or the client went away while waiting
                if writer.is_closing() or reader.at_eof():
                    return
                continue
            await self._send(writer, reply)

    def _authorize(self, peer: Peer, request: Request) -> None:
        d = self.config.daemon
        if peer.uid == 0 or self._in_group(peer):
            return
        if (request.op in READ_ONLY or (request.op == "park" and not request.remove)) and d.status_public:
            return
        who = f"user {peer.user} (uid {peer.uid})"
        if not d.socket_group:
            raise PermissionDenied(f"{who} may not {request.op}: only root may (daemon.socket_group is empty)")
        raise PermissionDenied(f"{who} may not {request.op}: only root and members of group "
                               f"{d.socket_group!r} may (add the user to it: usermod -aG {d.socket_group} {peer.user})")

    async def _send(self, writer: asyncio.StreamWriter, message: JsonObject) -> None:
        writer.write(encode(message))
        await asyncio.wait_for(writer.drain(), WRITE_S)

    async def _dispatch(self, peer: Peer, req: Request, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> JsonObject | None:
        d = self.config.daemon
        if (req.op in ("release", "renew") and peer.uid != 0) or (req.op == "acquire" and req.holder is None):
            peer = await self._identify(peer)
        if req.op == "acquire":
            return await self._acquire(peer, req, reader, writer)
        if req.op == "release":
            if req.lease is not None:
                gone = await self.window.release(lease_id=req.lease, allowed=peer.owns)
            else:
                gone = await self.window.release(match=self._mine(peer, req.holder))
            return {"ok": True, "released": [lease.to_dict() for lease in gone]}
        if req.op == "renew":
            lease_id = req.lease or self._only_lease(peer, req.holder)
            duration, capped = self._cap(req.duration or d.default_lease, peer)
            lease, claim = await self.window.renew(lease_id, duration, allowed=peer.owns)
            reply: JsonObject = {"ok": True, "lease": lease.to_dict(clock.now()),
                                 "capped": capped or claim is not None,
                                 "capped_by": "fair_after" if claim is not None else "max_lease" if capped else None}
            if claim is not None:
                reply["waiting"] = {"holder": claim.holder, "profile": claim.profile,
                                    "waited_s": round(clock.now() - claim.since, 3)}
            return reply
        if req.op == "status":
            verify = self.config.window.verify
            return {"ok": True, "version": __version__, "daemon_started_at": round(clock.to_wall(self.started_at), 3),
                    "instance": self.instance, "gpu_index": self.config.gpu.index,
                    "endpoint": {"url": verify.url, "model": verify.model}, "profiles": self._profiles(),
                    **self.window.status()}
        if req.op == "park":
            if req.remove:
                return {"ok": True, "removed": await self.window.remove_parked()}
            return {"ok": True, "parked": self.window.status()["parked"]}
        if req.op == "watch":
            if self.watchers is None:
                raise RequestError("this gpuswapd has no events to watch")
            await self.watchers.serve(peer.holder, reader, writer)
            return None  # it ends when the client hangs up or falls behind
        if req.op == "history":
            history = await self.outside.state.call("read_history", self.store.history, req.limit)
            return {"ok": True, "windows": history}
        self._profile(req.profile)
        return {"ok": True, "plan": (await self.planner(req.profile)).to_dict()}

    def _profile(self, name: str) -> Profile:
        try:
            return self.config.profile(name)
        except KeyError:
            known = ", ".join(p.name for p in self.config.all_profiles())
            raise UnknownProfile(f"no profile {name!r}: this gpuswapd has {known} ([window] is \"default\", "
                                 "the others are [profiles.NAME] in its configuration)") from None

    def _profiles(self) -> JsonObject:
        """Describe each profile for ``status``: its kind, what it needs, where its engine answers."""
        out: JsonObject = {}
        for p in self.config.all_profiles():
            endpoint: JsonObject | None = None
            if p.window is not None:
                endpoint = {"url": p.window.verify.url, "model": p.window.verify.model,
                            "health_url": p.window.health_url, "container": p.window.container.name}
            out[p.name] = {"kind": p.kind, "needs_bytes": p.needs, "needs": format_size(p.needs),
                           "endpoint": endpoint, "gpu_index": self.config.gpu.index}
        return out

    def _mine(self, peer: Peer, holder: str | None) -> Callable[[Lease], bool]:
        """Match the caller's leases (of ``holder``, if named); refuse if it names another's."""
        match = _callers(peer, holder)
        named = [lease for lease in self.window.leases() if match(lease)]
        mine = [lease for lease in named if peer.owns(lease)]
        if not named:
            raise LeaseNotFound(f"{holder or peer.holder} holds no lease{self.window.closed_because()}")
        if not mine:
            lease = named[0]
            owner = f"unit {lease.unit}" if lease.unit else f"uid {lease.uid}"
            raise PermissionDenied(f"the leases of {holder} belong to {owner}: only that owner or root may end them")
        return lambda lease: match(lease) and peer.owns(lease)

    def _only_lease(self, peer: Peer, holder: str | None) -> str:
        mine = self._mine(peer, holder)
        held = [lease for lease in self.window.leases() if mine(lease)]
        if len(held) > 1:
            raise LeaseNotFound(f"{holder or peer.holder} holds {len(held)} leases: name the lease to renew")
        return held[0].id

    def _cap(self, duration: float, peer: Peer) -> tuple[float, bool]:
        if math.isinf(duration):
            # A lease "for infinity" ends only by an explicit release (a Slurm Epilog, the reconciler).
            if peer.uid != 0:
                raise PermissionDenied(f"only root may take a lease for infinity (user {peer.user}, uid {peer.uid}): "
                                       f"ask for a span of at most daemon.max_lease = "
                                       f"{format_span(self.config.daemon.max_lease)}")
            return duration, False
        cap = self.config.daemon.max_lease
        return min(duration, cap), duration > cap

    async def _acquire(self, peer: Peer, req: Request, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> JsonObject | None:
        """Check an acquire, wait for its lease, hand it over, and keep the connection if asked to."""
        duration, capped = self._cap(req.duration or self.config.daemon.default_lease, peer)
        profile = self._profile(req.profile)
        self._check_priority(peer, req.priority)
        started = clock.monotonic()
        progress = self._progress_to(writer, req.holder or peer.holder)
        # Its reclaim token, told first: a client whose gpuswapd restarts sends it back ("reclaim").
        token = req.reclaim or ids.token(16)
        progress({"event": "accepted", "token": token, "reclaim_s": self.config.daemon.reclaim_grace})
        hashed = token_hash(token)
        lease = await self.window.reclaim(hashed, peer.owns) if req.reclaim is not None else None
        if lease is None:
            since = self.window.reclaimed_since(hashed, profile.name) if req.reclaim is not None else None
            acquire = asyncio.create_task(self.window.acquire(
                req.holder or peer.holder, duration, unit=None if req.holder else peer.unit, uid=peer.uid,
                wait=req.wait, listener=progress, profile=profile.name, priority=req.priority, bound=req.bind,
                token=hashed, since=since))
            retrieve(acquire)
            lease = await self._until_granted(acquire, peer, req, reader)
            if lease is None:
                return None
        await self._hand_over(lease, writer, profile, capped=capped, started=started, token=token)
        if req.hold or req.bind or lease.bound:
            await self._hold(lease, reader, progress)
        return None

    def _check_priority(self, peer: Peer, priority: int) -> None:
        """Refuse a non-root caller a priority outside the daemon's bounds for non-root."""
        most, least = self.config.daemon.priority_max_nonroot, self.config.daemon.priority_min_nonroot
        if priority > most and peer.uid != 0:
            raise PermissionDenied(f"priority {priority} is above daemon.priority_max_nonroot = {most}: only "
                                   f"root may ask for more (user {peer.user}, uid {peer.uid})")
        if priority < least and peer.uid != 0:
            raise PermissionDenied(f"priority {priority} is below daemon.priority_min_nonroot = {least}: only "
                                   f"root may ask for less (user {peer.user}, uid {peer.uid}); ask for {least} "
                                   "or more")

    def _progress_to(self, writer: asyncio.StreamWriter, holder: str) -> Callable[[JsonObject], None]:
        """Make the listener that writes a waiting client's progress events, cutting one that does not read."""

        def progress(event: JsonObject) -> None:
            if writer.is_closing():
                return
            if writer.transport.get_write_buffer_size() > self.max_buffered:
                # A client that does not read its progress would make gpuswapd buffer without end:
                # cut it, which withdraws its request (as a hang-up does).
                log.warning("client_dropped_unread", holder=holder,
                            reason=f"it left more than {self.max_buffered} bytes of progress unread")
                writer.transport.abort()
                return
            writer.write(encode(event))

        return progress

    async def _until_granted(self, acquire: asyncio.Task[Lease], peer: Peer, req: Request,
                             reader: asyncio.StreamReader) -> Lease | None:
        """Wait for the acquire, the client's hang-up or the request's timeout; None if the client went away."""
        # The client sends nothing while it waits; EOF means it went away (killed, timed out).
        gone = asyncio.create_task(reader.read(1))
        retrieve(gone)
        try:
            done, _ = await asyncio.wait({acquire, gone}, timeout=req.timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if acquire in done:
            return acquire.result()
        acquire.cancel()
        with contextlib.suppress(asyncio.CancelledError, GpuswapError):
            await acquire
        if gone in done:
            log.info("acquire_withdrawn", holder=req.holder or peer.holder, reason="client went away")
            return None
        raise AcquireTimeout(f"the window was not ready within {req.timeout:g}s (phase now "
                             f"{self.window.phase}); the acquire was withdrawn", phase=str(self.window.phase))

    async def _hand_over(self, lease: Lease, writer: asyncio.StreamWriter, profile: Profile, *, capped: bool,
                         started: float, token: str) -> None:
        """Send a granted lease to its client, or release it if the client cannot have it."""
        try:
            if lease.unit is not None and not (await self.outside.systemd.call("unit_state", self.units.state,
                                                                              lease.unit)).active:
                # The unit died while it waited: its watcher may have fired before the lease existed.
                await self.window.unit_gone(lease.unit)
            await self._send(writer, {"ok": True, "lease": {**lease.to_dict(clock.now()), "token": token},
                                      "capped": capped,
                                      "waited_s": round(clock.monotonic() - started, 3), "profile": profile.name,
                                      "kind": profile.kind, "gpu_index": self.config.gpu.index})
        except BaseException:
            # Its client never heard of the lease (it hung up, or this failed): nobody holds it.
            with contextlib.suppress(GpuswapError):
                await asyncio.shield(self.window.release(lease.id))
            raise

    async def _hold(self, lease: Lease, reader: asyncio.StreamReader, tell: Callable[[JsonObject], None]) -> None:
        """Keep a lease holder's connection for its events (a preemption's notice) until it hangs up.

        Renew and release come on connections of their own. A lease bound to this connection
        (``"bind": "connection"``) ends when the client hangs up, or dies: not when gpuswapd itself
        stops (a lease it keeps across a restart is ended at the next start, its connection gone).
        """
        self.window.lease_watchers[lease.id] = tell
        self.window.end_watchers("ended")  # it may have ended already
        mine = True
        try:
            with contextlib.suppress(ConnectionError):
                while await reader.read(4096):
                    pass  # the client says nothing more; anything it sends is ignored
        finally:
            mine = self.window.lease_watchers.get(lease.id) is tell
            if mine:
                del self.window.lease_watchers[lease.id]
        # A lease its client reclaimed on a newer connection is that connection's now.
        if lease.bound and mine and lease.id in {x.id for x in self.window.leases()}:
            with contextlib.suppress(GpuswapError):
                await asyncio.shield(self.window.release(lease.id, reason="its connection ended"))


def _pending(sock: socket.socket, most: int) -> list[socket.socket]:
    """Take connections that are already waiting, without blocking (an error: leave it to sock_accept)."""
    out: list[socket.socket] = []
    while len(out) < most:
        try:
            conn, _ = sock.accept()
        except OSError:  # none waiting (EAGAIN), or out of descriptors: the loop's accept handles it
            break
        out.append(conn)
    return out


def _refuse(conn: socket.socket, reason: str) -> None:
    """Tell a connection over the caps why, in one line, and close it (never blocking)."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(encode(error_reply(TooManyClients(reason))))
    conn.close()


def _callers(peer: Peer, holder: str | None) -> Callable[[Lease], bool]:
    """Match the leases a caller means when it names no lease id.

    ``--holder NAME`` means that holder's; a service means its own (its unit's); a person at a
    shell means every lease their user took from outside a unit.
    """
    if holder is not None:
        return lambda lease: lease.holder == holder
    if peer.unit is not None:
        return lambda lease: lease.unit == peer.unit or lease.holder == peer.unit
    return lambda lease: lease.unit is None and lease.uid == peer.uid
