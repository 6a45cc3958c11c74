"""Bounded and owned, on the real world: floods, leases only their owners end, refusal before anything moves."""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuswapd.adapters.unitnames import cgroup_of
from tests.integration.conftest import assert_resident_back, assert_window_open, ctl_as, ctl_output
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, Probe
from tests.stack.users import GROUP, MEMBERS, STRANGER, User, as_user
from tests.stack.world import SIM_PYTHON, Stack

Start = Callable[..., RunningDaemon]
ALICE, BOB = MEMBERS


@contextlib.contextmanager
def untouched(probe: Probe) -> Iterator[None]:
    """Check that nothing of the resident moved meanwhile."""
    since = {u: probe.entered_active_us(u) for u in ("strata.service", "llama-swap.service")}
    timers = probe.states(list(AGENT_TIMERS))
    yield
    assert {u: probe.entered_active_us(u) for u in since} == since, "a resident unit was restarted"
    assert probe.states(list(AGENT_TIMERS)) == timers == dict.fromkeys(AGENT_TIMERS, "active")
    assert probe.containers() == []


# -- who may do what ---------------------------------------------------------------------------


def test_a_member_cannot_end_or_renew_another_members_lease_and_root_can(
        gpuswapd: Start, probe: Probe, users: dict[str, User]) -> None:
    daemon = gpuswapd(daemon={"socket_group": GROUP})
    code, out, err = ctl_as(users[ALICE], daemon, "acquire", "--for", "5m", "--json")
    assert code == 0, err
    lease = json.loads(out)["lease"]
    assert lease["uid"] == users[ALICE].uid and lease["unit"] is None
    holder = lease["holder"]

    for args in (("release", lease["id"]), ("renew", lease["id"], "--for", "1h"), ("release", "--holder", holder),
                 ("renew", "--holder", holder, "--for", "1h")):
        code, _, err = ctl_as(users[BOB], daemon, *args)
        assert code == 4, (args, err)
        assert "only that owner or root may" in err and f"uid {users[ALICE].uid}" in err, err
    [kept] = daemon.status()["window"]["leases"]
    assert kept["id"] == lease["id"] and kept["expires_at"] == lease["expires_at"]  # intact, not renewed

    code, _, err = ctl_as(users[ALICE], daemon, "renew", "--for", "6m")  # its owner may
    assert code == 0, err
    assert daemon.ctl("release", lease["id"]).returncode == 0  # and root may end anyone's
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


def test_a_stranger_reads_status_but_may_not_acquire_or_release(
        gpuswapd: Start, probe: Probe, users: dict[str, User]) -> None:
    daemon = gpuswapd(daemon={"socket_group": GROUP, "status_public": True})
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o666"
    code, out, err = ctl_as(users[STRANGER], daemon, "status", "--json")
    assert code == 0, err
    assert json.loads(out)["phase"] == "IDLE"
    with untouched(probe):
        for args in (("acquire", "--for", "1m"), ("release",), ("plan",)):
            code, _, err = ctl_as(users[STRANGER], daemon, *args)
            assert code == 4 and f"group '{GROUP}'" in err, (args, err)


def test_without_status_public_a_stranger_is_kept_off_the_socket_and_told_by_whom(
        gpuswapd: Start, users: dict[str, User]) -> None:
    daemon = gpuswapd(daemon={"socket_group": GROUP, "status_public": False})
    code, _, err = ctl_as(users[STRANGER], daemon, "status")
    assert code == 3 and f"group '{GROUP}'" in err and "0660" in err, err


USER_MANAGER_UNIT = """\
[Unit]
Description=Stands in for user {uid}'s systemd --user: its cgroup is delegated, tests make cgroups in it
DefaultDependencies=no

[Service]
Slice=user-{uid}.slice
Delegate=yes
ExecStart=/usr/bin/sleep infinity
"""


def _hierarchy_of(line: str) -> Path:
    """The mount point of the hierarchy of one /proc/PID/cgroup line (cgroup v2, or v1's name=systemd)."""
    unified = line.startswith("0::")
    for entry in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = entry.partition(" - ")
        fstype, _, options = tail.split(" ", 2)
        if (unified and fstype == "cgroup2") or (not unified and fstype == "cgroup" and "name=systemd" in options):
            return Path(fields.split()[4])
    raise AssertionError(f"no mount of the hierarchy of {line!r} in /proc/self/mountinfo")


def _cgroup_line_ending(suffix: str) -> str | None:
    """The /proc/PID/cgroup line, as gpuswapd reads it, of a process whose cgroup ends with ``suffix``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            lines = (proc / "cgroup").read_text().splitlines()
            chosen = [ln for ln in lines if ln.startswith("0::") and ln != "0::/"] or \
                [ln for ln in lines if ":name=systemd:" in ln]
            if chosen and chosen[0].endswith(suffix):
                return chosen[0]
    return None


@pytest.fixture
def forged_cgroup(world: Stack, probe: Probe) -> Iterator[Callable[[User, str], Path]]:
    """Make cgroups inside a user manager's delegated cgroup, as a ``systemctl --user`` service has them.

    The world's systemd runs ``user@UID.service`` (a stand-in with ``Delegate=yes``, in
    ``user-UID.slice``), and the cgroups are made in its subtree, on cgroup v2 (or in systemd's
    named hierarchy where the world's systemd uses that): what a user's manager may make, and what
    a cgroup posing as a system unit looks like on a real machine. Removed after.
    """
    made: list[Path] = []
    units: dict[int, Path] = {}

    def delegated(user: User) -> Path:
        if user.uid not in units:
            unit = f"user@{user.uid}.service"
            world.install_unit(unit, USER_MANAGER_UNIT.format(uid=user.uid))
            world.manager("StartUnit", "ss", unit, "replace")
            # Its MainPID is a PID of the world's namespace: find its process here by its cgroup.
            deadline = time.monotonic() + 30
            while (line := _cgroup_line_ending(f"/user-{user.uid}.slice/{unit}")) is None:
                assert time.monotonic() < deadline, f"{unit} did not start: {probe.active_state(unit)}"
                time.sleep(0.05)
            relative = line.split(":", 2)[2].strip().lstrip("/")
            units[user.uid] = _hierarchy_of(line) / relative
        return units[user.uid]

    def make(user: User, inside: str) -> Path:
        path = delegated(user) / inside
        path.mkdir(parents=True, exist_ok=True)
        made.append(path)
        return path

    yield make
    for path in made:
        for group in (path, *path.parents):
            if group in units.values():
                break
            with contextlib.suppress(OSError):  # one made by another call, not empty yet
                group.rmdir()
    for uid in units:
        world.manager("StopUnit", "ss", f"user@{uid}.service", "replace", check=False)


def _ctl_in_cgroup(group: Path, user: User, daemon: RunningDaemon, *args: str) -> tuple[int, str, str]:
    """Run gpuswapctl as ``user`` from inside ``group``: moved there while still root, then dropped."""
    code, out, err = as_user(user, lambda: ctl_output(daemon, args), cgroup=group)
    return int(code), str(out), str(err)


def test_a_service_of_a_user_manager_gets_a_lease_of_its_uid_and_cannot_pose_as_a_system_unit(
        gpuswapd: Start, probe: Probe, users: dict[str, User], forged_cgroup: Callable[[User, str], Path]) -> None:
    daemon = gpuswapd(daemon={"socket_group": GROUP})
    alice = users[ALICE]
    user_job = forged_cgroup(alice, "app.slice/job.service")
    # The caller is where it says, in the hierarchy gpuswapd reads: under the user manager's unit.
    seen = as_user(alice, lambda: cgroup_of(os.getpid()), cgroup=user_job)
    assert str(seen).endswith(f"/user-{alice.uid}.slice/user@{alice.uid}.service/app.slice/job.service"), seen
    code, out, err = _ctl_in_cgroup(user_job, alice, daemon, "acquire", "--for", "5m", "--json")
    assert code == 0, err
    lease = json.loads(out)["lease"]
    # Bound to the user, not to a "job.service" the system manager has never heard of: it lasts.
    assert lease["unit"] is None and lease["uid"] == alice.uid
    time.sleep(1.0)
    assert [x["id"] for x in daemon.status()["window"]["leases"]] == [lease["id"]]

    # A cgroup that only looks like the system's strata.service is not strata.service.
    posing = forged_cgroup(alice, "app.slice/strata.service")
    root_lease = daemon.ctl_json("acquire", "--for", "5m", "--holder", "strata.service")["lease"]
    code, _, err = _ctl_in_cgroup(posing, users[BOB], daemon, "release", "--holder", "strata.service")
    assert code == 4, err
    assert {x["id"] for x in daemon.status()["window"]["leases"]} == {lease["id"], root_lease["id"]}
    assert daemon.ctl("release", "--holder", "strata.service").returncode == 0
    code, _, err = _ctl_in_cgroup(user_job, alice, daemon, "release")
    assert code == 0, err
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)


# -- floods ------------------------------------------------------------------------------------


def _flood(path: str, count: int, fds: tuple[int, int, int, int]) -> dict[str, int]:
    """Open ``count`` connections and hold them until the parent closes its end; count the refusals."""
    ready_r, ready_fd, done_fd, done_w = fds
    os.close(ready_r)
    os.close(done_w)  # or the read below would wait for this very process to close it
    socks, refused = [], 0
    watch = selectors.DefaultSelector()
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
        watch.register(s, selectors.EVENT_READ)
    deadline = time.monotonic() + 20
    answered = 0
    while answered < count - 64 and time.monotonic() < deadline:
        for key, _ in watch.select(0.5):
            data = key.fileobj.recv(4096)  # type: ignore[union-attr]
            refused += b"too_many_clients" in data
            answered += 1
            watch.unregister(key.fileobj)
    os.write(ready_fd, b"x")
    os.read(done_fd, 1)  # the parent closes its end when the test is done
    return {"opened": len(socks), "refused": refused}


def test_two_thousand_connections_from_one_user_leave_root_an_answer_and_a_window(
        gpuswapd: Start, probe: Probe, users: dict[str, User]) -> None:
    daemon = gpuswapd(nofile=1024)
    log_from = daemon.log.stat().st_size  # the log of this run only
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    result: dict[str, Any] = {}

    def flood() -> None:
        try:
            result.update(as_user(users[STRANGER],
                                  lambda: _flood(str(daemon.socket), 2000, (ready_r, ready_w, done_r, done_w)),
                                  nofile=4096))
        except BaseException as err:
            result["error"] = repr(err)

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        assert select.select([ready_r], [], [], 60)[0], "the flood never got its connections"
        os.read(ready_r, 1)
        latencies = []
        for _ in range(5):
            started = time.monotonic()
            assert daemon.ctl("status", "--json").returncode == 0
            latencies.append(time.monotonic() - started)
        assert max(latencies) < 5, latencies
        lease = daemon.ctl_json("acquire", "--for", "5m")["lease"]
        assert_window_open(probe)
        assert daemon.ctl("release", lease["id"]).returncode == 0
        daemon.wait_phase("IDLE", timeout=90)
        assert_resident_back(probe)
    finally:
        os.close(done_w)
        flooder.join(60)
        for fd in (ready_r, ready_w, done_r):
            os.close(fd)
    assert "error" not in result, result["error"]
    assert result["opened"] == 2000 and result["refused"] >= 2000 - 32 - 64, result
    log = daemon.log.read_bytes()[log_from:].decode(errors="replace")
    assert log.count('"clients_refused"') <= 3  # once a minute per user, with a count: no flood in the log
    assert "accept_out_of_resources" not in log and "Too many open files" not in log
    assert daemon.proc is not None and daemon.proc.poll() is None


# -- refusal before anything moves ---------------------------------------------------------------


@pytest.fixture
def stray(world: Stack) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """A process outside every unit that holds VRAM (a notebook, another user's job)."""
    started: list[subprocess.Popen[bytes]] = []

    def hold(size: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([SIM_PYTHON, str(world.paths.sim / "gpu_hold.py"), "--dir", str(world.paths.gpu),
                                 "--name", "stray", "--bytes", size, "--", "/bin/sleep", "600"])
        deadline = time.monotonic() + 10
        while not any(h["name"] == "stray" for h in world.ledger()["holders"]):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        started.append(proc)
        return proc

    yield hold
    for proc in started:
        proc.kill()  # by its PID: it is ours
        proc.wait()


def test_a_stray_process_holding_vram_is_refused_before_anything_is_touched(
        gpuswapd: Start, probe: Probe, stray: Callable[[str], subprocess.Popen[bytes]]) -> None:
    daemon = gpuswapd(gpu={"window_needs": "22GiB", "resident_needs": "22GiB"})
    notebook = stray("2.5GiB")
    with untouched(probe):
        started = time.monotonic()
        out = daemon.ctl("acquire", "--for", "1m")
        assert time.monotonic() - started < 10  # at once: no release_timeout spent waiting
    assert out.returncode == 1
    assert "the window cannot fit" in out.stderr and f"by pid {notebook.pid}" in out.stderr, out.stderr
    status = daemon.status()
    assert status["last"]["outcome"] == "refused" and status["last"]["error"]["code"] == "wont_fit"
    plan = json.loads(daemon.ctl("plan", "--json").stdout)["plan"]  # exits 1: a window would fail now
    assert not plan["ok"] and any(h["pid"] == notebook.pid for h in plan["vram"]["held_by_others"])


def test_vram_held_under_a_user_managers_strata_service_is_a_strangers_and_refused_at_once(
        gpuswapd: Start, probe: Probe, world: Stack, users: dict[str, User],
        forged_cgroup: Callable[[User, str], Path]) -> None:
    # systemd-run --user --unit=strata.service: a cgroup ending in strata.service under user@UID.service.
    alice = users[ALICE]
    posing = forged_cgroup(alice, "app.slice/strata.service")
    daemon = gpuswapd(gpu={"window_needs": "22GiB", "resident_needs": "22GiB"})
    hog = subprocess.Popen([SIM_PYTHON, str(world.paths.sim / "gpu_hold.py"), "--dir", str(world.paths.gpu),
                            "--name", "hog", "--bytes", "2.5GiB", "--", "/bin/sleep", "600"],
                           preexec_fn=lambda: (posing / "cgroup.procs").write_text(str(os.getpid())))
    try:
        deadline = time.monotonic() + 10
        while not any(h["name"] == "hog" for h in world.ledger()["holders"]):
            assert time.monotonic() < deadline and hog.poll() is None
            time.sleep(0.05)
        assert str(cgroup_of(hog.pid)).endswith(f"/user@{alice.uid}.service/app.slice/strata.service")
        with untouched(probe):
            started = time.monotonic()
            out = daemon.ctl("acquire", "--for", "1m")
            assert time.monotonic() - started < 10  # at once: no release_timeout spent waiting
        assert out.returncode == 1, out.stderr
        assert "the window cannot fit" in out.stderr and f"by pid {hog.pid} (a stranger's" in out.stderr, out.stderr
        assert f"user@{alice.uid}.service" in out.stderr, out.stderr
        status = daemon.status()
        assert status["last"]["outcome"] == "refused" and status["last"]["error"]["code"] == "wont_fit"
    finally:
        hog.kill()  # by its PID: it is ours
        hog.wait()


def test_a_hung_gpu_probe_fails_the_acquire_within_its_deadline_and_stops_nothing(
        gpuswapd: Start, probe: Probe, world: Stack) -> None:
    daemon = gpuswapd(gpu={"probe_timeout": "2s"})
    (world.paths.gpu / "nvidia-smi.hang").write_text("")
    with untouched(probe):
        acquiring = subprocess.Popen([str(Path(sys.executable).parent / "gpuswapctl"), "acquire", "--for", "1m"],
                                     env=daemon.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        started = time.monotonic()
        assert daemon.ctl("status", "--json", timeout=10).returncode == 0  # still answers meanwhile
        assert time.monotonic() - started < 3
        _, err = acquiring.communicate(timeout=30)
    assert acquiring.returncode == 1 and "did not answer within 2s" in err, err
    (world.paths.gpu / "nvidia-smi.hang").unlink()


def test_an_unreadable_env_file_is_refused_before_anything_is_touched(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(window__container={"env_file": "/nonexistent/gpuswapd-test.env"})
    with untouched(probe):
        out = daemon.ctl("acquire", "--for", "1m")
    assert out.returncode == 1 and "cannot read the env file '/nonexistent/gpuswapd-test.env'" in out.stderr


def test_orphan_clean_up_removes_only_this_instances_engines(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    def container(name: str, *labels: str) -> None:
        args = [a for label in labels for a in ("--label", label)]
        world.docker("create", "--name", name, *args, "hyperqwen-sim:latest", check=True)

    container("other-instance", "io.gpuswapd.managed=1", "io.gpuswapd.instance=gpu1", "io.gpuswapd.window=w1")
    container("ours", "io.gpuswapd.managed=1", "io.gpuswapd.instance=default", "io.gpuswapd.window=w2")
    container("ours-from-0.1", "io.gpuswapd.managed=1", "io.gpuswapd.window=w3")
    container("not-gpuswapds")
    gpuswapd()
    assert sorted(c["Names"] for c in probe.containers()) == ["not-gpuswapds", "other-instance"]
