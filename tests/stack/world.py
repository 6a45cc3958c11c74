"""The test world: a real systemd with its own D-Bus, a real dockerd, a simulated GPU.

systemd 252 runs as PID 1 of its own PID+mount namespace (``unshare``), with a private tmpfs
on /tmp (a systemd that reached sysinit.target with the host's /tmp visible would wipe it) and
``STACKDIR/run`` bind-mounted on /run, so its system bus is reachable from outside at
``STACKDIR/run/dbus/system_bus_socket``. Killing that namespace's PID 1 ends every process in it.

dockerd runs on its own socket, in a mount namespace of its own but in the host's PID namespace,
as on a real box: there gpuswapd, ``nvidia-smi`` (whose driver lists host PIDs) and dockerd all
number processes alike, so the PIDs ``docker top`` gives gpuswapd for a container are the ones
the card lists its memory under. (In a PID namespace of its own, dockerd would name the engine by
PIDs the card never shows, and gpuswapd could not tell its own engine's memory from a stranger's.)
The VRAM ledger's driver (``ledger.py driver``) runs in the host's PID namespace too, so that each
holder's host PID is known while it lives, and still listed while its memory is being freed.

``down`` removes every container before it stops dockerd (which stops its containerd with it),
and it only ever signals the PIDs it recorded at ``up``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.stack import llama, units

DEFAULT_ROOT = Path(os.environ.get("GPUSWAPD_STACK_DIR", "/var/tmp/gpuswapd-stack"))
SIM_PYTHON = "/usr/bin/python3"  # stdlib only: the same interpreter runs in the container
ENGINE_IMAGE = "hyperqwen-sim:latest"
AGENTS = ("triage", "review", "digest", "summarize", "index", "lint", "report")
OTHER_TIMER = "backup-models.timer"
VRAM_TOTAL = "24GiB"
RESIDENT_VRAM = "21GiB"
ENGINE_VRAM = "19.5GiB"
RELEASE_LAG_S = 0.5
# llama-swap moved off 8080 (docs/using/gateway.md): the gateway's port.
RESIDENT_PORT, PROXY_PORT, ENGINE_PORT, GATEWAY_PORT = 8081, 8090, 18020, 8080
# How the world is laid out and booted: a running world laid out otherwise (other simulators, or
# an older recipe) is booted afresh by ``up``, since its copies of the simulators are its own.
RECIPE = "3: dockerd in the host PID namespace; the ledger's driver"
REPO = Path(__file__).resolve().parents[2]
HELD_ENV = "GPUSWAPD_STACK_HELD"


def _bus_escape(name: str) -> str:
    """Escape a unit name the way systemd names its D-Bus object path."""
    return "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in name)


class StackError(RuntimeError):
    """The test world could not be brought up or down."""


@dataclass(frozen=True)
class Paths:
    """Where everything of one stack lives."""

    root: Path

    @property
    def run(self) -> Path:
        """Return the directory bind-mounted on /run inside the namespace."""
        return self.root / "run"

    @property
    def units(self) -> Path:
        """Return the namespace systemd's only unit directory."""
        return self.root / "units"

    @property
    def sim(self) -> Path:
        """Return the copy of the simulators that units run."""
        return self.root / "sim"

    @property
    def bin(self) -> Path:
        """Return the directory with the fake nvidia-smi."""
        return self.root / "bin"

    @property
    def gpu(self) -> Path:
        """Return the VRAM ledger's directory."""
        return self.root / "gpu"

    @property
    def control(self) -> Path:
        """Return the directory of knobs tests turn (agent hold files)."""
        return self.root / "control"

    @property
    def logs(self) -> Path:
        """Return the directory of every process's log."""
        return self.root / "logs"

    @property
    def slots(self) -> Path:
        """Return strata's --slot-save-path: where llama-server saves its slots for gpuswapd."""
        return self.root / "slots"

    @property
    def docker(self) -> Path:
        """Return dockerd's data and exec roots."""
        return self.root / "docker"

    @property
    def bus(self) -> Path:
        """Return the namespace's system bus socket."""
        return self.run / "dbus" / "system_bus_socket"

    @property
    def docker_sock(self) -> Path:
        """Return dockerd's API socket."""
        return self.root / "docker.sock"

    @property
    def pids(self) -> Path:
        """Return the record of the processes ``up`` started."""
        return self.root / "pids.json"

    @property
    def driver(self) -> Path:
        """Return the record of the ledger's driver (apart: it ends by itself with the world)."""
        return self.root / "driver.json"

    @property
    def recipe(self) -> Path:
        """Return the fingerprint of the simulators and the recipe the running world was booted from."""
        return self.root / "world.json"


def _start_time(pid: int) -> int | None:
    """Read a process's start time (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    """The PIDs of a process's children, theirs, and so on (a snapshot)."""
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += _children(child)
    return found


@dataclass(frozen=True)
class Proc:
    """A process ``up`` started, identified by PID and start time (PIDs get reused)."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> Proc:
        """Identify a running process."""
        start = _start_time(pid)
        if start is None:
            raise StackError(f"process {pid} is gone")
        return cls(pid, start)

    @classmethod
    def of_or_none(cls, pid: int) -> Proc | None:
        """Identify a process that may have exited already."""
        start = _start_time(pid)
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        """Tell whether this very process still runs (and is not a zombie)."""
        if _start_time(self.pid) != self.start:
            return False
        with contextlib.suppress(OSError):
            return " Z " not in Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1][:4]
        return False

    def signal(self, sig: int) -> None:
        """Send a signal if this very process still runs."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait_gone(self, timeout: float) -> bool:
        """Wait until the process has exited (reaping it if it is our child)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self.pid, os.WNOHANG)
            if not self.alive():
                return True
            time.sleep(0.05)
        return False


def _stop_tree(proc: Proc, timeout: float) -> None:
    """SIGTERM a process, SIGKILL it after ``timeout``; then make sure its descendants went too.

    dockerd shares the host's PID namespace (the module's docstring): its containerd, its child,
    is not ended by dockerd's exit, as the end of a namespace would end it; dockerd stops it
    (SIGTERM) when it stops, and a dockerd that had to be killed leaves it to us.
    """
    below = [p for p in (Proc.of_or_none(pid) for pid in _descendants(proc.pid)) if p is not None]
    proc.signal(signal.SIGTERM)
    if not proc.wait_gone(timeout):
        proc.signal(signal.SIGKILL)
        proc.wait_gone(10)
    for child in below:
        if not child.wait_gone(10):
            child.signal(signal.SIGKILL)
            child.wait_gone(10)


def _wait(what: str, check: Any, timeout: float, interval: float = 0.1) -> Any:
    """Poll ``check()`` until it returns something true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as err:  # the thing is still coming up
            last = err
        else:
            if last:
                return last
        time.sleep(interval)
    raise StackError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")


def _tail(path: Path, lines: int = 8) -> str:
    """The last lines of a log, for an error that says why something did not come up."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"(unreadable: {err})"


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_status(url: str, timeout: float = 2.0) -> int:
    """GET a URL and return its status code (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


class Stack:
    """One test world, rooted in a directory outside /tmp."""

    def __init__(self, root: Path = DEFAULT_ROOT, cache: Path = llama.DEFAULT_CACHE_DIR,
                 release_lag_s: float = RELEASE_LAG_S) -> None:
        self.paths = Paths(root)
        self.cache = cache
        self.release_lag_s = release_lag_s  # how long VRAM stays used after its holder died

    # -- what tests and the demo read -------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Return the environment that points gpuswapd and its tools at this stack."""
        return {
            "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={self.paths.bus}",
            "DOCKER_HOST": f"unix://{self.paths.docker_sock}",
            "GPUSIM_DIR": str(self.paths.gpu),
            "PATH": f"{self.paths.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        }

    def systemd_pid(self) -> int:
        """Return the host PID of the world's systemd (PID 1 of its namespace): nsenter's target."""
        proc = self._procs().get("systemd")
        if proc is None or not proc.alive():
            raise StackError("the test world's systemd does not run")
        return proc.pid

    def _procs(self) -> dict[str, Proc]:
        try:
            data = json.loads(self.paths.pids.read_text())
        except (OSError, ValueError):
            return {}
        return {name: Proc(**p) for name, p in data.items()}

    def running(self) -> bool:
        """Tell whether this stack's systemd and dockerd are up."""
        procs = self._procs()
        return bool(procs) and all(p.alive() for p in procs.values())

    def _fingerprint(self) -> str:
        """Hash the recipe and the simulators this checkout would lay the world out with."""
        digest = hashlib.sha256(RECIPE.encode())
        for f in sorted((Path(__file__).parent / "standins").glob("*.py")):
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        return digest.hexdigest()[:16]

    def _laid_out_here(self) -> bool:
        """Tell whether the running world was laid out from this checkout's recipe and simulators.

        The record names the systemd it was written for: a world booted since by a checkout that
        writes no record is not taken for this one.
        """
        try:
            record = json.loads(self.paths.recipe.read_text())
            systemd = self._procs().get("systemd")
            return (systemd is not None and record.get("systemd") == vars(systemd)
                    and record.get("fingerprint") == self._fingerprint())
        except (OSError, ValueError, AttributeError):
            return False

    # -- up ---------------------------------------------------------------------------------

    def up(self) -> float:
        """Bring the stack up (building what is missing); return the boot time in seconds."""
        if os.geteuid() != 0:
            raise StackError("the test world needs root (it boots systemd and dockerd)")
        llama.ensure_llama_server(self.cache)
        models = {kind: llama.ensure_model(self.cache, kind) for kind in ("tiny", "slow")}
        if self.running() and self._units_as_rendered() and self._laid_out_here():
            self.reset()
            return 0.0
        # Not running, or running units or simulators of another checkout (llama-swap on another
        # port, a ledger that lists no exited process, dockerd in a PID namespace of its own): anew.
        if self.running():
            print("the running test world was laid out by another checkout: booting it afresh", file=sys.stderr)
        self.down()
        for port in (RESIDENT_PORT, PROXY_PORT, ENGINE_PORT, GATEWAY_PORT):
            if _listening(port):
                raise StackError(f"port {port} is taken by a process outside the test world: "
                                 f"`ss -ltnp 'sport = :{port}'` shows which")
        started = time.monotonic()
        self._lay_out(models)
        try:
            self._boot_systemd()
            self._start_driver()
            self._boot_dockerd()
            self._import_image()
            self.wait_baseline()
        except BaseException:
            self.down()
            raise
        self.paths.recipe.write_text(json.dumps({"recipe": RECIPE, "fingerprint": self._fingerprint(),
                                                 "systemd": vars(self._procs()["systemd"])}))
        return time.monotonic() - started

    def _units_as_rendered(self) -> bool:
        """Tell whether the running world's unit files are the ones this checkout writes."""
        try:
            return all((self.paths.units / name).read_text() == text
                       for name, text in units.render(self._spec()).items())
        except OSError:
            return False

    def _lay_out(self, models: dict[str, Path]) -> None:
        p = self.paths
        for d in (p.run, p.units, p.bin, p.gpu, p.control, p.logs, p.slots, p.docker / "data", p.docker / "exec"):
            d.mkdir(parents=True, exist_ok=True)
        for stale in (p.run, p.units, p.control):
            for child in stale.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        shutil.rmtree(p.sim, ignore_errors=True)
        shutil.copytree(Path(__file__).parent / "standins", p.sim, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.rmtree(p.gpu, ignore_errors=True)
        self._ledger("init", "--total", VRAM_TOTAL, "--lag", str(self.release_lag_s))
        smi = p.bin / "nvidia-smi"
        smi.write_text(f'#!/bin/sh\nGPUSIM_DIR={p.gpu} exec {SIM_PYTHON} {p.sim}/nvidia_smi.py "$@"\n')
        smi.chmod(0o755)
        self.use_model(models["tiny"])
        for name, text in units.render(self._spec()).items():
            (p.units / name).write_text(text)
        boot = p.root / "boot.sh"
        # Units run gpuswapd from this checkout and its .venv: if they live under /tmp, carry them
        # across the private /tmp below.
        carry = p.root / "carry"
        keep = (
            f"mkdir -p {carry} && mount --bind {REPO} {carry}\n",
            f"mkdir -p {REPO} && mount --bind {carry} {REPO}\n",
        )
        if not str(REPO).startswith("/tmp/"):
            keep = ("", "")
        boot.write_text(
            "#!/bin/sh\nset -e\n"
            "mount --make-rprivate /\n"
            f"{keep[0]}"
            # A private /tmp before systemd starts: its tmpfiles cleanup must never see the host's.
            "mount -t tmpfs tmpfs /tmp\n"
            f"{keep[1]}"
            f"mount --bind {p.run} /run\n"
            "mkdir -p /run/systemd/system /run/dbus\n"
            f"export container=gpuswapd-test SYSTEMD_UNIT_PATH={p.units}\n"
            "exec /usr/lib/systemd/systemd --unit=stack.target\n"
        )
        boot.chmod(0o755)

    def _spec(self) -> units.Spec:
        p = self.paths
        return units.Spec(
            root=p.root,
            python=SIM_PYTHON,
            sim=p.sim,
            gpu=p.gpu,
            control=p.control,
            logs=p.logs,
            slots=p.slots,
            llama_server=llama.server_path(self.cache),
            model=self.resident_model,
            agents=AGENTS,
            other_timer=OTHER_TIMER,
            resident_vram=RESIDENT_VRAM,
            resident_port=RESIDENT_PORT,
            proxy_port=PROXY_PORT,
        )

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log = open(self.paths.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        with log:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        # unshare --fork: the namespace's PID 1 is unshare's child; killing it ends the namespace.
        pid1 = _wait(f"{name} to start", lambda: (_children(child.pid) or [None])[0], 10, 0.01)
        proc = Proc.of(pid1)
        # Recorded at once: a failure later in up() must still leave down() able to stop it.
        procs = self._procs()
        procs[name] = proc
        self.paths.pids.write_text(json.dumps({k: vars(v) for k, v in procs.items()}))
        return proc

    def _boot_systemd(self) -> Proc:
        proc = self._spawn(
            "systemd", ["unshare", "--pid", "--fork", "--mount", "--mount-proc", str(self.paths.root / "boot.sh")]
        )
        try:
            _wait("the stack's system bus", lambda: self.bus("list", check=False) is not None, 30)
        except StackError as err:
            log = self.paths.logs / "systemd.log"
            raise StackError(f"{err}; the end of {log}:\n{_tail(log)}") from None
        return proc

    def _driver(self) -> Proc | None:
        try:
            return Proc(**json.loads(self.paths.driver.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _start_driver(self) -> None:
        """Start the ledger's driver in this (the host's) PID namespace, unless it runs; it ends with systemd."""
        driver = self._driver()
        if driver is not None and driver.alive():
            return
        systemd = self._procs()["systemd"]
        log = open(self.paths.logs / "ledger-driver.log", "ab")  # noqa: SIM115 - handed to the child
        with log:
            child = subprocess.Popen(
                [SIM_PYTHON, str(self.paths.sim / "ledger.py"), "--dir", str(self.paths.gpu), "driver",
                 "--while", f"{systemd.pid}:{systemd.start}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self.paths.driver.write_text(json.dumps(vars(Proc.of(child.pid))))

    def _forget_containerd(self) -> None:
        """Clear what an earlier dockerd's containerd left in the exec root, before dockerd starts.

        dockerd trusts containerd's pid file: if the PID in it is alive it waits for that
        containerd's socket instead of starting its own, and times out ("timeout waiting for
        containerd to start") when the PID has been reused (a kernel thread's, another world's
        namespace). A containerd of this world's own exec root is stopped by its PID; any other
        process under that PID is left alone, and only the file goes.
        """
        state = self.paths.docker / "exec" / "containerd"
        pidfile = state / "containerd.pid"
        try:
            pid = int(pidfile.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid > 0:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                cmdline = []
            if cmdline and Path(cmdline[0].decode(errors="replace")).name == "containerd" and \
                    any(str(state).encode() in arg for arg in cmdline):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                _wait("the last world's containerd to exit", lambda: not Path(f"/proc/{pid}").exists(), 10)
        pidfile.unlink(missing_ok=True)

    def _boot_dockerd(self) -> Proc:
        p = self.paths
        # A world whose processes died without down() (a machine restart, a SIGKILLed session)
        # leaves dockerd's pid file behind, and dockerd refuses to start over it. The PID in it
        # may be anyone's by now (or a dead namespace's), so only the socket can tell whether a
        # dockerd is there.
        pidfile = p.docker / "dockerd.pid"
        if pidfile.exists():
            if self.docker("version", "--format", "{{.Server.Version}}").returncode == 0:
                raise StackError(f"a dockerd this world did not record answers on {p.docker_sock}: "
                                 f"stop it (its PID is in {pidfile}, as its own namespace numbers it) and retry")
            pidfile.unlink()
        self._forget_containerd()
        proc = self._spawn(
            "dockerd",
            [
                # Its own mounts, the host's PIDs (see the module's docstring).
                "unshare",
                "--mount",
                "--fork",
                "dockerd",
                "--host",
                f"unix://{p.docker_sock}",
                "--data-root",
                str(p.docker / "data"),
                "--exec-root",
                str(p.docker / "exec"),
                "--pidfile",
                str(p.docker / "dockerd.pid"),
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
                "--storage-driver=vfs",
            ],
        )
        try:
            _wait("dockerd", lambda: self.docker("version", "--format", "{{.Server.Version}}").returncode == 0, 60)
        except StackError as err:
            raise StackError(f"{err}; the end of {p.logs / 'dockerd.log'}:\n{_tail(p.logs / 'dockerd.log')}") from None
        return proc

    def bus(self, *args: str, check: bool = True) -> Any:
        """Run ``busctl --system ARGS`` against the world's bus; return the reply's data (None if it failed)."""
        out = subprocess.run(["busctl", "--system", "--json=short", *args], env={**os.environ, **self.env()},
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            if check:
                raise StackError(f"busctl {' '.join(args)}: {out.stderr.strip()}")
            return None
        if not out.stdout.strip():
            return True
        reply = json.loads(out.stdout)
        return reply["data"] if isinstance(reply, dict) and "data" in reply else reply

    def manager(self, method: str, *args: str, check: bool = True) -> Any:
        """Call a method of the world's systemd manager (``manager("StartUnit", "ss", unit, mode)``)."""
        return self.bus("call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                        "org.freedesktop.systemd1.Manager", method, *args, check=check)

    def docker(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this stack's dockerd."""
        return subprocess.run(
            ["docker", *args], env={**os.environ, **self.env()}, check=check, capture_output=True, text=True, timeout=60
        )

    def _ledger(self, *args: str) -> str:
        out = subprocess.run(
            [SIM_PYTHON, str(self.paths.sim / "ledger.py"), "--dir", str(self.paths.gpu), *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout

    def ledger(self, card: int = 0) -> dict[str, Any]:
        """Read the VRAM ledger of GPU ``card``: total, used, free, holders."""
        snapshot: dict[str, Any] = json.loads(self._ledger("show", *(["--card", str(card)] if card else [])))
        return snapshot

    def set_release_lag(self, seconds: float) -> None:
        """Make the card free memory ``seconds`` after it is let go (the next ``reset`` puts this stack's lag back)."""
        self._ledger("lag", str(seconds))

    def ooms(self) -> list[dict[str, Any]]:
        """List the CUDA out-of-memory failures the ledger recorded."""
        found: list[dict[str, Any]] = json.loads(self._ledger("ooms"))
        return found

    def _import_image(self) -> None:
        """Make the engine's image without a registry: a tiny rootfs; /usr comes from the host."""
        tar_path = self.paths.root / "engine-rootfs.tar"
        with tarfile.open(tar_path, "w") as tar:
            for d in ("usr", "etc", "tmp", "proc", "sys", "dev", "gpu", "opt", "opt/engine"):
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
                tar.addfile(info)
            for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            for f in sorted(self.paths.sim.glob("*.py")):
                tar.add(f, arcname=f"opt/engine/{f.name}")
        self.docker(
            "import",
            "--change",
            f'CMD ["{SIM_PYTHON}", "/opt/engine/engine_sim.py"]',
            str(tar_path),
            ENGINE_IMAGE,
            check=True,
        )

    @property
    def resident_model(self) -> Path:
        """Return the path strata's llama-server loads: a link to the tiny or the slow model."""
        return self.paths.root / "models" / "strata.gguf"

    def use_model(self, model: Path) -> bool:
        """Point strata at ``model`` (it takes effect when strata restarts); tell if it changed."""
        link = self.resident_model
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and link.resolve() == model.resolve():
            return False
        tmp = link.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(model)
        tmp.replace(link)
        return True

    # -- state between tests ----------------------------------------------------------------

    def wait_baseline(self, timeout: float = 60) -> None:
        """Wait until the resident serves through the proxy and every timer is armed."""
        try:
            _wait("strata /health 200", lambda: http_status(f"http://127.0.0.1:{RESIDENT_PORT}/health") == 200,
                  timeout)
            _wait("llama-swap /health 200", lambda: http_status(f"http://127.0.0.1:{PROXY_PORT}/health") == 200,
                  timeout)
        except StackError as err:
            raise StackError(f"{err}\n{self.resident_report()}") from err

    def resident_report(self) -> str:
        """What to read when the resident does not come up: its units' states, the card, strata's log's tail."""
        lines = []
        for unit in ("strata.service", "llama-swap.service"):
            try:
                lines.append(f"{unit}: {self._active_state(unit)}")
            except Exception as err:
                lines.append(f"{unit}: unread ({err})")
        try:
            ledger = self.ledger()
            lines.append(f"card: used {ledger.get('used_bytes')} of {ledger.get('total_bytes')}, holders "
                         f"{[(h.get('name'), h.get('pid'), h.get('bytes')) for h in ledger.get('holders', [])]}, "
                         f"ooms {self.ooms()[-3:]}")
        except Exception as err:
            lines.append(f"card: unread ({err})")
        try:
            tail = (self.paths.logs / "strata.log").read_bytes()[-1500:].decode(errors="replace")
            lines.append("strata.log's tail:\n" + tail)
        except OSError as err:
            lines.append(f"strata.log: unread ({err})")
        return "\n".join(lines)

    def reset(self) -> None:
        """Return a running stack to its baseline: no containers, all units up, no faults."""
        if not self._procs()["dockerd"].alive():
            self.start_dockerd()
        self._start_driver()
        for cid in self.docker("ps", "-aq").stdout.split():
            self.docker("rm", "-f", cid)
        for f in self.paths.control.iterdir():
            f.unlink()
        self._remove_extra_units()
        for f in ("engine-fault.json", "nvidia-smi.fail", "nvidia-smi.hang"):
            (self.paths.gpu / f).unlink(missing_ok=True)
        if self.use_model(llama.ensure_model(self.cache, "tiny")):
            self.restart_resident()
        # One card again, if a test gave it a second (tests/stack/cards.py); this stack's lag, if
        # the world was brought up by another user of it (a benchmark, the demo).
        self._ledger("reset", "--cards", "1", "--lag", str(self.release_lag_s))
        self.manager("StartUnit", "ss", "stack.target", "replace")
        self.wait_baseline()

    def install_unit(self, name: str, text: str | None, dropins: dict[str, str] | None = None) -> None:
        """Add a unit (or, with ``text=None``, drop-ins to an existing one) and reload systemd."""
        if text is not None:
            (self.paths.units / name).write_text(text)
        if dropins:
            d = self.paths.units / f"{name}.d"
            d.mkdir(exist_ok=True)
            for conf, body in dropins.items():
                (d / conf).write_text(body)
        self._reload()

    def remove_dropins(self, name: str) -> None:
        """Remove a unit's drop-ins and reload systemd."""
        shutil.rmtree(self.paths.units / f"{name}.d", ignore_errors=True)
        self._reload()

    def stop_dockerd(self) -> None:
        """Stop the world's dockerd (as a crash of Docker would look to gpuswapd)."""
        _stop_tree(self._procs()["dockerd"], 30)

    def start_dockerd(self) -> None:
        """Start the world's dockerd again (after ``stop_dockerd``)."""
        self._boot_dockerd()

    def _reload(self) -> None:
        self.manager("Reload")

    def _remove_extra_units(self) -> None:
        extra = [f for f in self.paths.units.iterdir() if f.name not in self._base_units]
        # A template (NAME@.service) has no state of its own: its loaded instances are what runs.
        running = [u for f in extra if not f.name.endswith(".d") for u in self._units_of(f.name)]
        for unit in running:
            self.manager("StopUnit", "ss", unit, "replace", check=False)
        for unit in running:
            _wait(f"{unit} to stop", lambda unit=unit: self._active_state(unit) in ("inactive", "failed"), 30)
        for f in extra:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        if extra:
            self._reload()
            self.manager("ResetFailed", check=False)

    def _units_of(self, name: str) -> list[str]:
        """Return the unit file's unit, or a template's loaded instances."""
        if "@." not in name:
            return [name]
        template, _, kind = name.partition("@.")
        rows = self.manager("ListUnitsByPatterns", "asas", "0", "1", f"{template}@*.{kind}", check=False)
        return [row[0] for row in rows[0]] if rows else []

    @property
    def _base_units(self) -> set[str]:
        return set(units.render(self._spec()).keys())

    def restart_resident(self) -> None:
        """Restart strata as a GPU needs it: stop, wait until the ledger freed its VRAM, start."""
        self.manager("StopUnit", "ss", "strata.service", "replace")
        _wait("strata to stop", lambda: self._active_state("strata.service") in ("inactive", "failed"), 30)
        _wait(
            "strata's VRAM to come free", lambda: all(h["name"] != "strata" for h in self.ledger()["holders"]), 30, 0.05
        )
        self.manager("StartUnit", "ss", "stack.target", "replace")
        _wait("strata to start", lambda: self._active_state("strata.service") == "active", 30)
        # CI once waited more than a minute for the slow model (250 MB) to serve, after a benchmark had
        # written 2.27 GB; a slow disk would explain it. A timeout now says what strata was doing.
        self.wait_baseline(timeout=180)

    def _active_state(self, unit: str) -> str:
        state: str = self.bus("get-property", "org.freedesktop.systemd1",
                              "/org/freedesktop/systemd1/unit/" + _bus_escape(unit), "org.freedesktop.systemd1.Unit",
                              "ActiveState")
        return state

    # -- down -------------------------------------------------------------------------------

    def down(self) -> None:
        """Stop everything ``up`` started, by recorded PID; leave nothing running."""
        procs = self._procs()
        dockerd, systemd = procs.get("dockerd"), procs.get("systemd")
        if dockerd and dockerd.alive():
            for cid in self.docker("ps", "-aq").stdout.split():
                self.docker("rm", "-f", cid)
            _stop_tree(dockerd, 20)
        if systemd and systemd.alive():
            # Stop the units cleanly first (their cgroups go with them), then end the namespace.
            self.manager("StartUnit", "ss", "stack-halt.target", "isolate", check=False)
            with contextlib.suppress(StackError):
                _wait("the stack's units to stop", lambda: not self._units_left(), 20)
            systemd.signal(signal.SIGKILL)
        driver = self._driver()
        if driver is not None:
            driver.signal(signal.SIGTERM)
            procs["driver"] = driver
        for name, proc in procs.items():
            if not proc.wait_gone(20):
                raise StackError(f"{name} (pid {proc.pid}) did not exit")
        self.paths.pids.unlink(missing_ok=True)
        self.paths.driver.unlink(missing_ok=True)
        self.paths.recipe.unlink(missing_ok=True)

    def _units_left(self) -> bool:
        rows = self.manager("ListUnitsByPatterns", "asas", "1", "active", "1", "*.service", check=False)
        return rows is None or any(row[0] != "dbus.service" for row in rows[0])

    # -- sharing one stack ------------------------------------------------------------------

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the stack for this process (ports are fixed: one stack at a time per machine).

        A child of the holder (the demo run by a test) shares the hold: ``GPUSWAPD_STACK_HELD``.
        """
        if os.environ.get(HELD_ENV) == str(self.paths.root):
            yield
            return
        self.paths.root.mkdir(parents=True, exist_ok=True)
        with open(self.paths.root.parent / f".{self.paths.root.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print("waiting for another user of the test world to finish…", file=sys.stderr)
                fcntl.flock(lock, fcntl.LOCK_EX)
            os.environ[HELD_ENV] = str(self.paths.root)
            try:
                yield
            finally:
                del os.environ[HELD_ENV]
