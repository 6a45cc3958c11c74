"""Local users for the tests of who may do what: members of the socket group, and a stranger.

The users are system accounts made with Debian's ``useradd`` and removed again by the fixture
that made them. A client runs as one of them in a forked child that drops root for good before
it speaks: its code is already in memory, so the checkout need not be readable by that user.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import resource
import subprocess
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUP = "gpuswap-test"
MEMBERS = ("gpuswap-alice", "gpuswap-bob")
STRANGER = "gpuswap-eve"


@dataclass(frozen=True)
class User:
    """A local account a client can run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def ensure_users() -> tuple[dict[str, User], list[str]]:
    """Make the group and the users if missing; return them and what was made (to remove after)."""
    made: list[str] = []
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", GROUP], check=True)
        made.append(f"group:{GROUP}")
    for name in (*MEMBERS, STRANGER):
        try:
            pwd.getpwnam(name)
        except KeyError:
            extra = ["--groups", GROUP] if name in MEMBERS else []
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", *extra, name],
                           check=True)
            made.append(f"user:{name}")
    users = {}
    for name in (*MEMBERS, STRANGER):
        pw = pwd.getpwnam(name)
        groups = tuple(os.getgrouplist(name, pw.pw_gid))
        users[name] = User(name, pw.pw_uid, pw.pw_gid, groups)
    return users, made


def remove(made: list[str]) -> None:
    """Remove the accounts ``ensure_users`` made."""
    for item in reversed(made):
        kind, _, name = item.partition(":")
        subprocess.run(["userdel" if kind == "user" else "groupdel", name], check=False, capture_output=True)


def as_user(user: User, func: Callable[[], Any], nofile: int | None = None, cgroup: Path | None = None) -> Any:
    """Run ``func`` in a child that is ``user`` (and nothing more); return what it returns (JSON).

    ``cgroup``: a cgroup directory the child moves itself into while still root.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, run, report, exit without cleanup handlers
        status = 0
        try:
            os.close(read_end)
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(os.getpid()))
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
            result = {"ok": func()}
        except BaseException:
            result = {"error": traceback.format_exc()}
            status = 1
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(result))
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    reply = json.loads(data or '{"error": "the child wrote nothing"}')
    if "error" in reply:
        raise AssertionError(f"as {user.name}: {reply['error']}")
    return reply["ok"]
