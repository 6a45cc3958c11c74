"""A single-node Slurm from Debian for the test world: munged, slurmctld and slurmd on ports of their own.

Started lazily (the ``slurm`` fixture), only for the Slurm tests. Everything lives under
``ROOT/slurm``: the munge key and socket, slurm.conf and gres.conf, state, spool, logs and a
private directory of fake GPU device nodes (``mknod … c 195 N``: with no real GPU, gres.conf
needs ``File=`` to register any; nothing ever opens them). Each daemon runs in the foreground as
a child of the test process, and ``stop`` signals only those PIDs.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.stack.world import REPO, StackError, _tail, _wait

CTLD_PORT, SLURMD_PORT = 16817, 16818
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


@dataclass
class Slurm:
    """A running single-node Slurm: its config, its daemons and the commands' environment."""

    root: Path
    node: str
    cards: int
    gpuswapd_env: dict[str, str]  # how the Prolog and Epilog find gpuswapd: the map, the runtime dir
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        """Return slurm.conf (gres.conf beside it)."""
        return self.root / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """Return the environment of Slurm's clients (sbatch, squeue, scontrol)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def cmd(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this Slurm."""
        out = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise StackError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr or out.stdout}")
        return out

    def job(self, job_id: str) -> dict[str, str]:
        """Read a job's fields from ``scontrol show job`` (Comment and AdminComment as they are)."""
        text = self.cmd("scontrol", "-o", "show", "job", job_id).stdout.strip()
        fields: dict[str, str] = {}
        for part in text.split(" "):
            key, eq, value = part.partition("=")
            if eq:
                fields[key] = value.strip()
            elif fields:  # a value with spaces (AdminComment): it runs on to the next key=value
                last = list(fields)[-1]
                fields[last] += " " + part
        return fields

    def wait_job(self, job_id: str, states: set[str], timeout: float = 60) -> dict[str, str]:
        """Wait until a job is in one of ``states`` (JobState)."""
        return _wait(f"job {job_id} in {sorted(states)}",  # type: ignore[no-any-return]
                     lambda: (j := self.job(job_id))["JobState"] in states and j, timeout)

    def resume(self) -> None:
        """Return the node to service (a failed Prolog drains it)."""
        self.cmd("scontrol", "update", f"NodeName={self.node}", "State=RESUME", check=False)
        _wait(f"node {self.node} idle", lambda: "IDLE" in self.cmd("sinfo", "-h", "-N", "-o", "%T").stdout.upper(),
              30)

    def stop(self) -> None:
        """Stop the daemons this Slurm started (by PID), slurmd first."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()


def _conf(root: Path, node: str, cards: int, prolog: Path, epilog: Path, munge_socket: Path) -> str:
    return f"""\
ClusterName=gpuswapd-test
SlurmctldHost={node}
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=1
Prolog={prolog}
Epilog={epilog}
PrologFlags=Alloc
PrologEpilogTimeout=120
NodeName={node} Gres=gpu:{cards} CPUs=2 State=UNKNOWN
PartitionName=gpu Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _script(path: Path, command: str, env: dict[str, str]) -> Path:
    exports = "\n".join(f"export {k}='{v}'" for k, v in env.items())
    # slurmd gives the Prolog and Epilog a minimal environment: everything they need is set here.
    path.write_text(f"#!/bin/sh\n{exports}\nexec {sys.executable} -m gpuswapd.ctl.main {command}\n")
    path.chmod(0o755)
    return path


def start(root: Path, gpuswapd_env: dict[str, str], cards: int = 1) -> Slurm:
    """Start munged, slurmctld and slurmd under ``root``; the Prolog and Epilog run gpuswapctl with ``gpuswapd_env``."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    if missing:
        raise StackError(f"{', '.join(missing)} not found: apt-get install -y {' '.join(PACKAGES)} "
                         "(bash tests/run setup installs them)")
    for port in (CTLD_PORT, SLURMD_PORT):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise StackError(f"port {port} is taken: `ss -ltnp 'sport = :{port}'` shows which")
    shutil.rmtree(root, ignore_errors=True)
    for d in ("etc", "state", "spool", "log", "run", "dev", "munge/key", "munge/run", "jobs"):
        (root / d).mkdir(parents=True, exist_ok=True)
    munge = pwd.getpwnam("munge")
    # munged refuses a key readable by others and a socket directory without execute for all.
    key = root / "munge" / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    for path, mode in ((key, 0o400), (key.parent, 0o700), (root / "munge" / "run", 0o755), (root / "munge", 0o755)):
        os.chown(path, munge.pw_uid, munge.pw_gid)
        path.chmod(mode)
    for n in range(cards):
        dev = root / "dev" / f"nvidia{n}"
        subprocess.run(["mknod", str(dev), "c", "195", str(n)], check=True)
    node = socket.gethostname().split(".")[0]
    env = {**gpuswapd_env, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
           "SLURM_CONF": str(root / "etc" / "slurm.conf")}
    prolog = _script(root / "etc" / "prolog.sh", "slurm-prolog", env)
    epilog = _script(root / "etc" / "epilog.sh", "slurm-epilog", env)
    munge_socket = root / "munge" / "run" / "munge.socket"
    slurm = Slurm(root, node, cards, gpuswapd_env)
    slurm.conf.write_text(_conf(root, node, cards, prolog, epilog, munge_socket))
    files = f"{root}/dev/nvidia[0-{cards - 1}]" if cards > 1 else f"{root}/dev/nvidia0"
    (root / "etc" / "gres.conf").write_text(f"Name=gpu File={files}\n")
    log = open(root / "log" / "daemons.log", "ab")  # noqa: SIM115 -- the daemons' output, for as long as they run
    try:
        slurm.procs.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "-F", "--key-file", str(key), "--socket", str(munge_socket),
             "--pid-file", str(root / "munge" / "run" / "munged.pid"), "--seed-file",
             str(root / "munge" / "run" / "munged.seed"), "--log-file", str(root / "log" / "munged.log")],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        _wait("munged's socket", munge_socket.exists, 15)
        for daemon in ("slurmctld", "slurmd"):
            slurm.procs.append(subprocess.Popen([daemon, "-D", "-f", str(slurm.conf)], env=slurm.env(),
                                                stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        started = time.monotonic()
        while True:
            state = slurm.cmd("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip().upper()
            if state.startswith("IDLE"):
                break
            dead = [str(p.args) for p in slurm.procs if p.poll() is not None]
            if dead or time.monotonic() - started > 60:
                raise StackError(f"Slurm's node is not idle ({state or 'no answer'}; exited: {dead}); "
                                 f"slurmctld.log:\n{_tail(root / 'log' / 'slurmctld.log')}\n"
                                 f"slurmd.log:\n{_tail(root / 'log' / 'slurmd.log')}")
            time.sleep(0.2)
    except BaseException:
        slurm.stop()
        raise
    finally:
        log.close()
    return slurm
