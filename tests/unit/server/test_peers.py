"""Who is asking: groups from the socket, a unit only when it is the caller's own, a reused pid refused.

On the fake host (processes, services, users in memory) through the real Server on a real Unix
socket, and on the real kernel: SO_PEERGROUPS and SO_PEERPIDFD of real processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuswapd import clock
from gpuswapd.adapters import kernel
from gpuswapd.adapters.unitstates import ServiceProcesses
from gpuswapd.errors import BusUnavailable, PermissionDenied
from gpuswapd.outside import Deadlines, Outside
from gpuswapd.server.listen import own_socket
from gpuswapd.server.peers import LinuxHost, Peer, PeerChanged, identify, named
from gpuswapd.server.server import Server
from gpuswapd.window.plan import Plan
from tests.fakes import FakeHost, FakeProcess, FakeUnit, FakeWorld, running, settle

ALICE, BOB, EVE = 1000, 1001, 1002
GROUP = 500  # the socket group: alice and bob are members, eve is not
JOBS = "/system.slice/jobs.service"  # a service that runs jobs for many users, as cron does
ROOT_MAIN, ROOT_JOB, ALICE_JOB, BOB_JOB = 100, 400, 200, 300


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def host_of(world: FakeWorld) -> FakeHost:
    """A host with a cron-like jobs.service (root's main process, jobs of alice, bob and root) and users."""
    host = FakeHost(world.systemd)
    host.users.update({"gpuswap-alice": ALICE, "gpuswap-bob": BOB, "gpuswap-eve": EVE})
    host.groups["gpuswap-test"] = GROUP
    world.systemd.add_unit(FakeUnit("jobs.service", pid=ROOT_MAIN))
    host.services["jobs.service"] = ServiceProcesses("jobs.service", "", False, ROOT_MAIN, 0)
    for pid, uid in ((ROOT_MAIN, 0), (ROOT_JOB, 0), (ALICE_JOB, ALICE), (BOB_JOB, BOB)):
        host.add(FakeProcess(pid, uid, uid, (GROUP,) if uid in (ALICE, BOB) else (), JOBS))
    return host


def serve(world: FakeWorld, host: FakeHost, tmp_path: Path, **daemon: Any) -> tuple[Server, Path]:
    config = dataclasses.replace(world.config, daemon=dataclasses.replace(
        world.config.daemon, socket_group="gpuswap-test", **daemon))
    window = world.window(Outside(Deadlines(systemd=5, docker=5, gpu=5, state=5, http=5, workers=4)))
    server = Server(config, window, world.store, world.systemd, window.outside,  # type: ignore[arg-type]
                    planner=lambda profile: asyncio.sleep(0, Plan.from_dict({})), host=host)
    return server, tmp_path / "gpuswapd.sock"


async def ask(server: Server, path: Path, message: dict[str, Any], then: Any = None) -> dict[str, Any]:
    """Connect, wait until the server has admitted us (the kernel's record is taken), run ``then``, ask."""
    host = server.host
    assert isinstance(host, FakeHost)
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        deadline = time.monotonic() + 5
        while host.waiting:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.002)
        if then is not None:
            then()
        writer.write(json.dumps(message).encode() + b"\n")
        while True:
            reply: dict[str, Any] = json.loads(await reader.readline())
            if "event" not in reply:
                return reply
    finally:
        writer.close()


# -- groups come from the socket ------------------------------------------------------------------


def test_a_stranger_whose_pid_a_member_reuses_is_still_a_stranger(tmp_path: Path) -> None:
    world = FakeWorld()
    host = host_of(world)
    host.add(FakeProcess(4242, EVE, EVE, ()))
    server, path = serve(world, host, tmp_path)

    def reuse() -> None:  # eve's process exits; a member's process gets its pid (its /proc says member)
        host.add(FakeProcess(4242, ALICE, ALICE, (GROUP,), started=2))

    async def main() -> None:
        async with running(server.window):
            await server.start(own_socket(str(path), "", 0o600))
            host.connect_as(4242)
            reply = await ask(server, path, {"op": "acquire", "for": 60, "holder": "forged"}, then=reuse)
            assert reply["error"]["code"] == "permission_denied", reply
            assert "uid 1002" in reply["error"]["message"] and "may not acquire" in reply["error"]["message"]
            assert server.window.phase.name == "IDLE" and not server.window.leases()
            host.connect_as(ALICE_JOB)  # a member is let in on its groups at connect
            assert (await ask(server, path, {"op": "plan"}))["ok"]
            await server.close()

    run(main())


def test_a_member_whose_pid_is_reused_in_another_service_is_refused_and_leaves_its_lease_alone(
        tmp_path: Path) -> None:
    world = FakeWorld()
    host = host_of(world)
    world.systemd.add_unit(FakeUnit("victim.service", pid=7000))
    host.services["victim.service"] = ServiceProcesses("victim.service", "gpuswap-bob", False, 7000, 0)
    host.add(FakeProcess(7000, BOB, BOB, (GROUP,), "/system.slice/victim.service"))
    host.add(FakeProcess(5000, ALICE, ALICE, (GROUP,)))  # alice at a shell: no unit
    server, path = serve(world, host, tmp_path)

    def reuse() -> None:  # alice's client exits; a process of victim.service gets its pid
        host.add(FakeProcess(5000, BOB, BOB, (GROUP,), "/system.slice/victim.service", started=9))

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            host.connect_as(7000)
            victims = await ask(server, path, {"op": "acquire", "for": 60})
            assert victims["ok"] and victims["lease"]["unit"] == "victim.service", victims
            host.connect_as(5000)
            reply = await ask(server, path, {"op": "release"}, then=reuse)
            assert reply["error"]["code"] == "permission_denied", reply
            assert "cannot tell which unit it runs in" in reply["error"]["message"]
            assert [x.id for x in w.leases()] == [victims["lease"]["id"]]  # untouched
            await w.release(victims["lease"]["id"])
            await settle(w)
            await server.close()

    run(main())


# -- a unit only when it is the caller's own ------------------------------------------------------


async def _identified(host: FakeHost, pid: int) -> Peer:
    creds = host.processes[pid]
    peer = Peer(pid, creds.uid, creds.gid, frozenset(creds.groups), started=creds.started)
    return await identify(peer, host, Outside(Deadlines(systemd=1, docker=1, gpu=1, state=1, http=1)).systemd)


def test_the_binding_rule() -> None:
    world = FakeWorld()
    host = host_of(world)
    # alice's own service, by User= (a name, or a uid), and one whose main process runs as alice
    for name, user, main in (("train.service", "gpuswap-alice", 0), ("numeric.service", str(ALICE), 0),
                             ("dropped.service", "", 8100), ("dynamic.service", "", 8200)):
        world.systemd.add_unit(FakeUnit(name))
        host.services[name] = ServiceProcesses(name, user, name == "dynamic.service", main, 0)
    host.add(FakeProcess(8100, ALICE, ALICE, (), "/system.slice/dropped.service"))
    host.add(FakeProcess(8200, 61000, 61000, (), "/system.slice/dynamic.service"))  # DynamicUser=yes
    for pid, cgroup in ((8001, "train"), (8002, "numeric"), (8101, "dropped")):
        host.add(FakeProcess(pid, ALICE, ALICE, (GROUP,), f"/system.slice/{cgroup}.service"))
    host.add(FakeProcess(8201, 61000, 61000, (), "/system.slice/dynamic.service"))
    host.add(FakeProcess(8003, BOB, BOB, (GROUP,), "/system.slice/train.service"))  # bob inside alice's unit
    # root: the main process and the control process (ExecStartPre=) of a root service are it
    world.systemd.add_unit(FakeUnit("rootjob.service"))
    host.services["rootjob.service"] = ServiceProcesses("rootjob.service", "", False, 9100, 9150)
    host.add(FakeProcess(9100, 0, 0, (), "/system.slice/rootjob.service"))
    host.add(FakeProcess(9150, 0, 0, (), "/system.slice/rootjob.service"))
    host.add(FakeProcess(9160, 0, 0, (), "/system.slice/rootjob.service"))  # a child of its main process

    async def main() -> dict[int, str | None]:
        pids = (ALICE_JOB, BOB_JOB, ROOT_JOB, ROOT_MAIN, 8001, 8002, 8101, 8201, 8003, 9100, 9150, 9160)
        return {pid: (await _identified(host, pid)).unit for pid in pids}

    assert run(main()) == {
        ALICE_JOB: None, BOB_JOB: None, ROOT_JOB: None,  # jobs in a service that runs them for many
        ROOT_MAIN: "jobs.service",  # the service's own main process
        8001: "train.service", 8002: "numeric.service", 8101: "dropped.service", 8201: "dynamic.service",
        8003: None,  # another uid inside alice's service
        9100: "rootjob.service", 9150: "rootjob.service", 9160: None,
    }


def test_two_uids_in_one_service_hold_leases_of_their_own_uids(tmp_path: Path) -> None:
    world = FakeWorld()
    host = host_of(world)
    server, path = serve(world, host, tmp_path)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            host.connect_as(ALICE_JOB)
            alice = await ask(server, path, {"op": "acquire", "for": 60})
            assert alice["ok"], alice
            assert (alice["lease"]["unit"], alice["lease"]["uid"]) == (None, ALICE)
            assert alice["lease"]["holder"] == f"gpuswap-alice[{ALICE_JOB}]"
            for request in ({"op": "release"}, {"op": "release", "lease": alice["lease"]["id"]},
                            {"op": "renew", "lease": alice["lease"]["id"], "for": 3600},
                            {"op": "release", "holder": alice["lease"]["holder"]}):
                host.connect_as(BOB_JOB)
                reply = await ask(server, path, request)
                assert not reply["ok"] and reply["error"]["code"] in ("permission_denied", "lease_not_found"), reply
            [kept] = w.leases()
            assert kept.id == alice["lease"]["id"]  # and its expiry unchanged (the wire's is a wall-clock time)
            assert abs(clock.to_wall(kept.expires_at) - alice["lease"]["expires_at"]) < 1
            # jobs.service going inactive does not end it: it was never that unit's
            await w.unit_gone("jobs.service")
            assert [x.id for x in w.leases()] == [kept.id]
            host.connect_as(ALICE_JOB)
            assert (await ask(server, path, {"op": "release"}))["ok"]
            await settle(w)
            await server.close()

    run(main())


def test_non_root_priorities_are_bounded_below(tmp_path: Path) -> None:
    world = FakeWorld()
    host = host_of(world)
    server, path = serve(world, host, tmp_path)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            host.connect_as(ALICE_JOB)
            reply = await ask(server, path, {"op": "acquire", "for": 60, "priority": -11})
            assert reply["error"]["code"] == "permission_denied", reply
            assert "daemon.priority_min_nonroot = -10" in reply["error"]["message"]
            assert not w.leases() and w.phase.name == "IDLE"
            host.connect_as(ALICE_JOB)
            ok = await ask(server, path, {"op": "acquire", "for": 60, "priority": -10})
            assert ok["ok"] and ok["lease"]["priority"] == -10
            host.connect_as(ROOT_MAIN)
            assert (await ask(server, path, {"op": "acquire", "for": 60, "priority": -500, "holder": "r"}))["ok"]
            for lease in w.leases():
                await w.release(lease.id)
            await settle(w)
            await server.close()

    run(main())


# -- the real kernel ------------------------------------------------------------------------------


def _listener(tmp_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "s.sock"))
    sock.listen(4)
    sock.settimeout(20)  # a client that never comes fails the test, not the run
    return sock


# A client in a process of its own: connect as uid/gid 65534 in no group, then join group 4242.
REGROUP = """
import os, socket, sys
os.setgroups([])
os.setresgid(65534, 65534, 0)
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect(sys.argv[1])
os.setgroups([4242])
print("joined", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.getuid() != 0, reason="changes its groups: needs root")
def test_the_kernel_keeps_the_groups_a_process_had_when_it_connected(tmp_path: Path) -> None:
    listener = _listener(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", REGROUP, str(tmp_path / "s.sock")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        conn, _ = listener.accept()
        assert child.stdout is not None and child.stdout.readline().strip() == "joined"
        status = Path(f"/proc/{child.pid}/status").read_text()
        assert "Groups:\t4242" in status  # what reading /proc by pid would believe
        peer = LinuxHost(None).peer(conn)  # type: ignore[arg-type]
        assert peer.pid == child.pid and peer.gid == 65534 and peer.groups == frozenset()
        assert not peer.member(4242)
        conn.close()
    finally:
        child.communicate("", timeout=20)
        listener.close()


def test_a_client_that_has_exited_is_not_read_under_its_pid(tmp_path: Path) -> None:
    listener = _listener(tmp_path)
    connect = "import socket, sys; socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(sys.argv[1])"
    child = subprocess.run([sys.executable, "-c", connect, str(tmp_path / "s.sock")], timeout=20, check=True)
    assert child.returncode == 0  # it is gone and reaped: its pid is free for anyone
    conn, _ = listener.accept()
    try:
        host = LinuxHost(None)  # type: ignore[arg-type]
        peer = host.peer(conn)
        assert not host.still(peer)
        with pytest.raises(PeerChanged, match="has exited"):
            host.process(peer)
        with pytest.raises(PermissionDenied, match=f"pid {peer.pid}"):
            run(identify(peer, host, Outside(Deadlines(systemd=1)).systemd))
        # a client still there is itself
        alive = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        alive.connect(str(tmp_path / "s.sock"))
        own, _ = listener.accept()
        me = host.peer(own)
        found = host.process(me)
        assert me.pid == os.getpid() and found is not None and found.uid == os.geteuid() and host.still(me)
        own.close()
        alive.close()
    finally:
        conn.close()
        listener.close()


def test_the_managers_pid_is_found_in_its_own_namespace(tmp_path: Path) -> None:
    """A manager in a PID namespace of its own (a container, the test world) numbers its processes there."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    unit = "/box/system.slice/train.service"

    def process(pid: int, uid: int, nspid: tuple[int, ...], cgroup: str) -> None:
        d = proc / str(pid)
        d.mkdir(parents=True)
        d.joinpath("status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
                                        f"NSpid:\t{' '.join(map(str, nspid))}\n")
        d.joinpath("stat").write_text(f"{pid} (a (b) c) S " + " ".join(["0"] * 18) + " 4711 0\n")
        d.joinpath("cgroup").write_text(f"0::{cgroup}\n")

    process(7, 0, (7,), "/init.scope")  # gpuswapd's pid 7: another process entirely
    process(5001, 1000, (5001, 7), unit)  # the manager's pid 7: the unit's main process
    process(5002, 1001, (5002, 40, 7), unit)  # a deeper namespace made inside the unit, posing as 7
    (cgroups / unit.lstrip("/")).mkdir(parents=True)
    (cgroups / unit.lstrip("/") / "cgroup.procs").write_text("5002\n5001\n")
    host = LinuxHost(None, proc, (cgroups,))  # type: ignore[arg-type]
    found = host.process_in(unit, 7)
    assert found is not None and (found.pid, found.uid, found.started) == (5001, 1000, 4711)
    assert host.process_in(unit, 8) is None
    assert kernel.read_process(5002, proc).nspid == (5002, 40, 7)


def test_when_systemd_cannot_say_whose_the_service_is_the_lease_is_the_uids() -> None:
    world = FakeWorld()
    host = host_of(world)
    world.systemd.add_unit(FakeUnit("train.service"))
    host.services["train.service"] = ServiceProcesses("train.service", "gpuswap-alice", False, 0, 0)
    host.add(FakeProcess(8001, ALICE, ALICE, (), "/system.slice/train.service"))

    def down(unit: str) -> ServiceProcesses:
        raise BusUnavailable("systemd did not answer")

    host.service = down  # type: ignore[method-assign]
    assert run(_identified(host, 8001)).unit is None


def test_with_proc_hidden_systemd_names_the_unit_and_a_caller_gone_meanwhile_is_refused() -> None:
    world = FakeWorld()
    host = host_of(world)
    world.systemd.add_unit(FakeUnit("train.service"))
    host.services["train.service"] = ServiceProcesses("train.service", "gpuswap-alice", False, 0, 0)
    host.add(FakeProcess(8001, ALICE, ALICE, (), "/system.slice/train.service"))
    host.process = lambda peer: None  # type: ignore[method-assign]  # hidepid=: /proc shows nothing
    assert run(_identified(host, 8001)).unit == "train.service"  # by User=, from systemd's word

    asked = host.unit_of_pid

    def exits_meanwhile(pid: int) -> str | None:
        unit = asked(pid)
        host.add(FakeProcess(8001, BOB, BOB, (), "/system.slice/other.service", started=5))  # reused
        return unit

    host.unit_of_pid = exits_meanwhile  # type: ignore[method-assign]
    with pytest.raises(PermissionDenied, match="has exited"):
        run(_identified(host, 8001))


def test_a_users_name_is_looked_up_off_the_event_loop_and_kept_a_minute() -> None:
    """LDAP or sssd can block a lookup: the loop serves everyone else meanwhile, and asks once a minute per uid."""

    class SlowDirectory:
        asked = 0

        def user_name(self, uid: int) -> str:
            SlowDirectory.asked += 1
            time.sleep(0.3)  # a directory server that is slow to answer
            return "alice"

    async def main() -> None:
        host, outside = SlowDirectory(), Outside()
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        peer = await named(Peer(4242, ALICE, ALICE), host, outside.systemd)  # type: ignore[arg-type]
        ticker.cancel()
        assert peer.user == "alice" and peer.holder == "alice[4242]"
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        assert len(ticks) > 10 and max(gaps) < 0.15, max(gaps)  # the loop never waited on the lookup
        again = await named(Peer(4243, ALICE, ALICE), host, outside.systemd)  # type: ignore[arg-type]
        assert again.user == "alice" and SlowDirectory.asked == 1  # kept: not asked again
        outside.close()

    run(main())
