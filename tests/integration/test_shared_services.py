"""Leases belong to their callers, on the real world: a service that runs jobs for several users.

jobs-runner.service runs, as cron does, jobs of alice, bob and root from its main process (a
root shell). None of them is the service itself: each lease is bound to its caller's uid, bob
cannot end or renew alice's, and a preemption stops nothing. cron.service (the test world's own:
its units are private) takes a lease from its root ExecStartPre=, which is bound to it, and a
preemption still leaves it running: it is in daemon.never_stop by default.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.conftest import assert_resident_back, ctl_as, wait_for, wait_state, with_profiles
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import Probe
from tests.stack.users import GROUP, MEMBERS, User
from tests.stack.world import REPO, Stack

Start = Callable[..., RunningDaemon]
ALICE, BOB = MEMBERS

# The jobs of jobs-runner.service, one after the other from its main process; their answers and
# exit codes land in OUT. A user's gpuswapctl runs from a copy of the package that user can read.
JOBS = """#!/bin/sh
OUT={out}
ctl() {{ env PYTHONPATH={pkg} GPUSWAPD_SOCKET={sock} PATH=/usr/bin:/bin /usr/bin/python3 -m gpuswapd.ctl.main "$@"; }}
as() {{ u=$1; shift; setpriv --reuid="$u" --regid="$(id -g "$u")" --init-groups \\
    env PYTHONPATH={pkg} GPUSWAPD_SOCKET={sock} PATH=/usr/bin:/bin /usr/bin/python3 -m gpuswapd.ctl.main "$@"; }}
field() {{ /usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["lease"][sys.argv[2]])' "$@"; }}
as {alice} acquire --for 5m --priority -5 --json > $OUT/alice.json 2> $OUT/alice.err
LEASE=$(field $OUT/alice.json id)
HOLDER=$(field $OUT/alice.json holder)
as {bob} release > /dev/null 2> $OUT/bob-release.err; echo $? > $OUT/bob-release.rc
as {bob} release "$LEASE" > /dev/null 2> $OUT/bob-release-id.err; echo $? > $OUT/bob-release-id.rc
as {bob} renew "$LEASE" --for 1h > /dev/null 2> $OUT/bob-renew.err; echo $? > $OUT/bob-renew.rc
as {bob} release --holder "$HOLDER" > /dev/null 2> $OUT/bob-release-holder.err; echo $? > $OUT/bob-release-holder.rc
ctl acquire --for 5m --priority -5 --json > $OUT/root.json 2> $OUT/root.err
touch $OUT/done
exec sleep 600
"""


def _package(world: Stack) -> Path:
    """Copy gpuswapd where every user can read it (the checkout may not be readable to them)."""
    pkg = world.paths.root / "pkg-shared"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(REPO / "gpuswapd", pkg / "gpuswapd", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [pkg, *pkg.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return pkg


def _lease_of(status: dict[str, Any], lease_id: str) -> dict[str, Any]:
    return next(x for x in (status["window"] or {}).get("leases", []) if x["id"] == lease_id)


def test_jobs_of_several_users_in_one_service_hold_leases_of_their_own_and_preemption_stops_no_shared_service(
        gpuswapd: Start, probe: Probe, world: Stack, users: dict[str, User]) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"socket_group": GROUP, "preempt_grace": "1s"})
    out = world.paths.root / "jobs-runner"  # world.reset() empties control/ of files only
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    script = world.paths.control / "jobs.sh"
    script.write_text(JOBS.format(out=out, pkg=_package(world), sock=daemon.socket, alice=ALICE, bob=BOB))
    script.chmod(0o755)
    world.install_unit("jobs-runner.service", "[Unit]\nDefaultDependencies=no\n[Service]\n"
                                              f"ExecStart=/bin/sh {script}\n")
    world.manager("StartUnit", "ss", "jobs-runner.service", "replace")
    wait_for((out / "done").exists, "the jobs", timeout=120)

    alice = json.loads((out / "alice.json").read_text())["lease"]
    assert (alice["unit"], alice["uid"]) == (None, users[ALICE].uid), alice
    assert alice["holder"].startswith(f"{ALICE}[")
    for attempt in ("release", "release-id", "renew", "release-holder"):
        said = (out / f"bob-{attempt}.err").read_text()
        assert (out / f"bob-{attempt}.rc").read_text().strip() == "4", (attempt, said)
    assert "only that owner or root may" in (out / "bob-renew.err").read_text()
    kept = _lease_of(daemon.status(), alice["id"])
    assert kept["expires_at"] == alice["expires_at"]  # neither ended nor renewed by bob
    root = json.loads((out / "root.json").read_text())["lease"]
    assert (root["unit"], root["uid"]) == (None, 0), root  # a root job is not the service either

    # cron.service's own ExecStartPre= (root, its control process): that lease is the unit's.
    world.install_unit("cron.service", "[Unit]\nDefaultDependencies=no\n[Service]\n"
                                       f"Environment=GPUSWAPD_SOCKET={daemon.socket}\n"
                                       f"ExecStartPre={BIN}/gpuswapctl acquire --for 5m --priority -5\n"
                                       "ExecStart=/bin/sleep 600\n")
    world.manager("StartUnit", "ss", "cron.service", "replace")
    wait_state(probe, "cron.service", {"active"})
    units = {x["holder"]: x["unit"] for x in daemon.status()["window"]["leases"]}
    assert units["cron.service"] == "cron.service", units

    # Bob asks for the card at priority 0: every lease (at -5) is preempted after the grace.
    done: dict[str, Any] = {}
    bob = threading.Thread(target=lambda: done.update(reply=ctl_as(
        users[BOB], daemon, "acquire", "--profile", "bare", "--for", "1m", "--json")))
    bob.start()
    bob.join(timeout=120)
    code, stdout, err = done["reply"]
    assert code == 0, err
    last = daemon.ctl_json("history", "--limit", "1")["windows"][-1]
    assert last["preempted"]["revoked_at"] is not None
    assert last["preempted"]["stopped_units"] == []  # cron.service: never_stop; jobs-runner: no lease of its own
    for unit in ("jobs-runner.service", "cron.service"):
        assert probe.active_state(unit) == "active", unit
    assert daemon.ctl("release", json.loads(stdout)["lease"]["id"]).returncode == 0
    daemon.wait_phase("IDLE", timeout=90)
    assert_resident_back(probe)
    assert probe.active_state("cron.service") == "active"
