"""The Arch package, built from this checkout by packaging/arch/build.sh; its hardened unit under systemd."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuswapd import __version__
from gpuswapd.ctl.main import build_parser
from tests.integration.conftest import assert_resident_back
from tests.stack.cards import RESIDENT1, instance_sections
from tests.stack.config import stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import Probe
from tests.stack.world import REPO, Stack

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "packaging" / "arch" / "build.sh"
BUILD_BUDGET_S = 180  # without the one-time download of the build tools

EXPECTED = {
    "usr/bin/gpuswapd": None,
    "usr/bin/gpuswapctl": None,
    "usr/bin/gpuswapd-gateway": None,
    "usr/lib/systemd/system/gpuswapd-gateway.service": "units/gpuswapd-gateway.service",
    "usr/lib/systemd/system/gpuswapd-gateway.socket": "units/gpuswapd-gateway.socket",
    "usr/share/man/man8/gpuswapd-gateway.8.gz": "packaging/man/gpuswapd-gateway.8",
    "usr/lib/systemd/system/gpuswapd.service": "units/gpuswapd.service",
    "usr/lib/systemd/system/gpuswapd.socket": "units/gpuswapd.socket",
    "usr/lib/systemd/system/gpuswapd@.service": "units/gpuswapd@.service",
    "usr/lib/systemd/system/gpuswapd@.socket": "units/gpuswapd@.socket",
    "usr/lib/sysusers.d/gpuswapd.conf": "units/sysusers.d/gpuswapd.conf",
    "usr/lib/tmpfiles.d/gpuswapd.conf": "units/tmpfiles.d/gpuswapd.conf",
    "etc/gpuswapd/gpuswapd.toml": "units/gpuswapd.toml",
    "usr/share/man/man1/gpuswapctl.1.gz": "packaging/man/gpuswapctl.1",
    "usr/share/man/man5/gpuswapd.toml.5.gz": "packaging/man/gpuswapd.toml.5",
    "usr/share/man/man8/gpuswapd.8.gz": "packaging/man/gpuswapd.8",
    "usr/share/bash-completion/completions/gpuswapctl": "packaging/completions/gpuswapctl.bash",
    "usr/share/zsh/site-functions/_gpuswapctl": "packaging/completions/_gpuswapctl",
    "usr/share/fish/vendor_completions.d/gpuswapctl.fish": "packaging/completions/gpuswapctl.fish",
    "usr/share/licenses/gpuswapd/LICENSE": "LICENSE",
    "usr/share/doc/gpuswapd/README.md": "README.md",
    "usr/share/doc/gpuswapd/docs/operating/install.md": "docs/operating/install.md",
    "usr/share/doc/gpuswapd/docs/reference/gpuswapd.8.md": "docs/reference/gpuswapd.8.md",
    "usr/share/doc/gpuswapd/gpuswap-lease.conf": "units/examples/gpuswap-lease.conf",
    "usr/share/doc/gpuswapd/examples/metrics-textfile.conf": "packaging/examples/metrics-textfile.conf",
    "usr/share/doc/gpuswapd/examples/gpuswap-notify": "packaging/examples/gpuswap-notify",
    **{f"usr/share/doc/gpuswapd/examples/{name}": f"units/examples/{name}" for name in (
        "vllm-openai.toml", "strata.service", "llama-swap.service", "llama-swap.yaml", "llama-swap-cmd/README.md",
        "llama-swap-cmd/llama-swap.service", "llama-swap-cmd/config.yaml", "llama-swap-cmd/gpuswapd.toml")},
    "usr/share/gpuswapd/grafana/gpuswapd.json": "packaging/grafana/gpuswapd.json",
    "usr/share/gpuswapd/known-bad.toml": "gpuswapd/data/known-bad.toml",
}


@dataclass
class Built:
    path: Path
    took_s: float
    members: dict[str, tarfile.TarInfo]
    tar: tarfile.TarFile

    def read(self, name: str) -> bytes:
        f = self.tar.extractfile(self.members[name])
        assert f is not None, name
        return f.read()

    def pkginfo(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for line in self.read(".PKGINFO").decode().splitlines():
            if " = " in line and not line.startswith("#"):
                key, _, value = line.partition(" = ")
                out.setdefault(key, []).append(value)
        return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """Build the package once per run (with check(): the unit tests run inside makepkg).

    Both xdist workers use this module (the world's tests on one, the rest on the other): the
    first to get here builds under a lock, in the run's shared temporary directory, and the other
    reads what it built.
    """
    if shutil.which("makepkg") is None:
        pytest.skip("makepkg is not installed (tests/run installs it)")
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "package"
    shared.mkdir(exist_ok=True)
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "built.txt"  # "<seconds the build took> <package path>"
        failed = shared / "failed.txt"  # the failed build's stderr, for the other worker to show
        if failed.exists():
            pytest.fail(f"the package build of this run failed:\n{failed.read_text()}")
        if not done.exists():
            out = shared / "pkg"
            out.mkdir(exist_ok=True)
            started = time.monotonic()
            proc = subprocess.run([str(BUILD), "--pkgdest", str(out)], capture_output=True, text=True,
                                  timeout=900)
            took = time.monotonic() - started
            if proc.returncode != 0:
                failed.write_text(proc.stderr[-6000:])
            assert proc.returncode == 0, proc.stderr[-6000:]
            lines = proc.stdout.strip().splitlines()
            assert len(lines) == 1, f"build.sh printed {proc.stdout!r}: the package path only, please"
            assert Path(lines[0]).parent == out.resolve()
            print(f"\npackage built in {took:.0f}s: {Path(lines[0]).name}")
            done.write_text(f"{took} {lines[0]}")
        took_s, _, name = done.read_text().partition(" ")
    path = Path(name)
    assert path.is_file()
    with tarfile.open(path) as tar:
        yield Built(path, float(took_s), {m.name: m for m in tar.getmembers()}, tar)


def test_build_sh_prints_the_package_it_built(built: Built) -> None:
    assert built.path.name == f"gpuswapd-{__version__}-1-any.pkg.tar.gz"


def test_package_holds_every_file_where_arch_expects_it(built: Built) -> None:
    missing = [name for name in EXPECTED if name not in built.members]
    assert not missing, f"not in the package: {missing}"
    for name, source in EXPECTED.items():
        if source is None:
            continue
        data = built.read(name)
        if name.endswith(".gz"):
            data = gzip.decompress(data)
        assert data == (ROOT / source).read_bytes(), f"{name} differs from {source}"
    assert built.members["usr/bin/gpuswapd"].mode & 0o111
    assert built.members["etc/gpuswapd/gpuswapd.toml"].mode & 0o777 == 0o644


def test_package_holds_the_python_package_and_nothing_stray(built: Built) -> None:
    names = set(built.members)
    init = [n for n in names if re.fullmatch(r"usr/lib/python3[^/]*/(site|dist)-packages/gpuswapd/__init__\.py", n)]
    assert len(init) == 1, sorted(n for n in names if n.endswith("__init__.py"))
    site = init[0].rpartition("/gpuswapd/")[0]
    assert f"{site}/gpuswapd/ctl/main.py" in names
    assert f"{site}/gpuswapd/data/known-bad.toml" in names  # package data: every install has the table
    assert built.members["etc/gpuswapd/known-bad.d"].isdir()  # the operator's rows go here
    assert f"{site}/gpuswapd-{__version__}.dist-info/entry_points.txt" in names
    for name in names - {".PKGINFO", ".BUILDINFO", ".MTREE"}:
        assert name.split("/")[0] in ("usr", "etc"), name
        assert "/tests/" not in name and "/packaging/" not in name, name
    # The scripts run the system's python, not a build-time virtualenv or scratch directory.
    for script in ("usr/bin/gpuswapd", "usr/bin/gpuswapctl", "usr/bin/gpuswapd-gateway"):
        shebang = built.read(script).split(b"\n", 1)[0].decode()
        assert re.fullmatch(r"#!/usr/bin/python3?(\.\d+)?", shebang), f"{script}: {shebang}"


def test_pkginfo_marks_the_config_as_backup_and_lists_the_dependencies(built: Built) -> None:
    info = built.pkginfo()
    assert info["pkgname"] == ["gpuswapd"]
    assert info["pkgver"] == [f"{__version__}-1"]
    assert info["arch"] == ["any"]
    assert info["backup"] == ["etc/gpuswapd/gpuswapd.toml"]
    assert set(info["depend"]) == {"python", "python-gobject", "python-pydbus", "python-httpx", "python-docker",
                                   "python-structlog", "python-nvidia-ml-py", "python-prometheus_client",
                                   "python-uvicorn", "python-httptools", "python-uvloop"}
    assert {d.split(":")[0] for d in info["optdepend"]} == {"docker", "nvidia-utils", "nvidia-container-toolkit"}


def test_installed_units_verify_against_the_package_tree(built: Built, tmp_path: Path) -> None:
    """systemd-analyze verify on a root made of the host's units and this package's files."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    built.tar.extractall(root, members=[m for m in built.tar.getmembers() if not m.name.startswith(".")],
                         filter="tar")
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "gpuswapd.service", "gpuswapd.socket", "gpuswapd@0.service",
         "gpuswapd@0.socket", "gpuswapd-gateway.service", "gpuswapd-gateway.socket"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "MANPATH": str(root / "usr/share/man")},
    )
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_packaged_gpuswapctl_runs(built: Built, tmp_path: Path) -> None:
    """The packaged gpuswapctl starts from the package's own files and knows every command."""
    root = tmp_path / "root"
    built.tar.extractall(root, members=[m for m in built.tar.getmembers() if m.name.startswith("usr/")],
                         filter="tar")
    site = next(root.glob("usr/lib/python3*/*-packages"))
    script = root / "usr/bin/gpuswapctl"
    interpreter = built.read("usr/bin/gpuswapctl").split(b"\n", 1)[0][2:].decode()
    proc = subprocess.run([interpreter, str(script), "--help"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"})
    assert proc.returncode == 0, proc.stderr
    action = next(a for a in build_parser()._actions if a.dest == "command")
    assert action.choices is not None
    for name in action.choices:
        assert name in proc.stdout


def test_packaged_gpuswapd_reads_the_known_bad_table_the_package_ships(built: Built, tmp_path: Path) -> None:
    """The packaged module finds its table as package data, and reads /usr/share's copy first."""
    root = tmp_path / "root"
    built.tar.extractall(root, members=[m for m in built.tar.getmembers() if m.name.startswith("usr/")],
                         filter="tar")
    site = next(root.glob("usr/lib/python3*/*-packages"))
    interpreter = built.read("usr/bin/gpuswapctl").split(b"\n", 1)[0][2:].decode()
    code = ("import json; from gpuswapd.checks import knownbad; t = knownbad.load_table(); "
            "print(json.dumps([knownbad.__file__, t.files, t.ids]))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1",
           "GPUSWAPD_KNOWN_BAD_DIR": str(tmp_path / "none")}
    for shipped in (None, root / "usr/share/gpuswapd/known-bad.toml"):
        extra = {} if shipped is None else {"GPUSWAPD_KNOWN_BAD": str(shipped)}
        proc = subprocess.run([interpreter, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**env, **extra})
        assert proc.returncode == 0, proc.stderr
        module, files, ids = json.loads(proc.stdout)
        assert module.startswith(str(site))
        if shipped is not None:
            assert files == [str(shipped)]
        elif not Path("/usr/share/gpuswapd/known-bad.toml").exists():  # a host with the package reads that
            assert files == [str(site / "gpuswapd/data/known-bad.toml")]
        assert ids[0] == "dflash-tokens-above-7-at-20k"


def test_build_stays_within_budget(built: Built) -> None:
    # The first build on a machine also downloads the build tools once (see build.sh).
    assert built.took_s < BUILD_BUDGET_S + 120


# --- the units as the package installs them, in the test world's systemd --------------------
#
# The service and socket units come out of the built package and run unchanged in the test
# world's systemd (a real systemd 252 with its own D-Bus; real dockerd; real llama-server), with a
# drop-in that only points them at this checkout and the world: where gpuswapd and its config
# are, how to reach the world's dockerd, and the world's directory and this checkout (PrivateTmp=
# hides /tmp and /var/tmp, where both may live).
# The socket lives at /run/gpuswapd inside the namespace, which is STACKDIR/run outside.


def _service_prop(world: Stack, name: str) -> str:
    return str(Probe(world).prop("gpuswapd.service", name, "org.freedesktop.systemd1.Service"))


def _main_pid(world: Stack) -> int:
    return int(_service_prop(world, "MainPID"))


def test_packaged_units_run_in_the_test_world(built: Built, world: Stack, probe: Probe) -> None:
    # As the package's install does: systemd-sysusers creates the socket's group.
    sysusers = world.paths.root / "gpuswapd-sysusers.conf"
    sysusers.write_bytes(built.read("usr/lib/sysusers.d/gpuswapd.conf"))
    subprocess.run(["systemd-sysusers", str(sysusers)], check=True, capture_output=True, timeout=60)
    config = stack_config(world, "packaged")
    sock = world.paths.run / "gpuswapd" / "gpuswapd.sock"
    env = world.env()
    world.install_unit("gpuswapd.socket", built.read("usr/lib/systemd/system/gpuswapd.socket").decode(),
                       {"test-world.conf": "[Unit]\nDefaultDependencies=no\n"})
    world.install_unit("gpuswapd.service", built.read("usr/lib/systemd/system/gpuswapd.service").decode(), {
        "test-world.conf": (
            "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\n"
            f"ExecStart={BIN}/gpuswapd --config {config}\n"
            f"Environment=DOCKER_HOST={env['DOCKER_HOST']} PATH={env['PATH']}\n"
            f"BindPaths={world.paths.root}\n"
            f"BindReadOnlyPaths={REPO}\n"
            # Short enough to watch it being fed within the test.
            "WatchdogSec=2s\n"
        )})
    world.manager("StartUnit", "ss", "gpuswapd.socket", "replace")
    daemon = RunningDaemon(world, config, sock)
    assert probe.active_state("gpuswapd.socket") == "active"
    assert probe.active_state("gpuswapd.service") == "inactive"

    status = daemon.ctl("status", "--json")  # the first connection starts gpuswapd.service
    assert status.returncode == 0, status.stderr
    assert probe.active_state("gpuswapd.service") == "active"  # Type=notify: only after READY=1
    assert _service_prop(world, "StatusText") == "IDLE"  # STATUS= from gpuswapd
    fields = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{_host_pid(world)}/status").read_text().splitlines()
                  if ":\t" in ln)
    assert int(fields["CapEff"], 16) == 0 and fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
    fed = int(_service_prop(world, "WatchdogTimestampMonotonic"))
    time.sleep(2.5)
    assert int(_service_prop(world, "WatchdogTimestampMonotonic")) > fed  # WATCHDOG=1 keeps coming
    assert probe.active_state("gpuswapd.service") == "active"

    acquire = daemon.ctl("acquire", "--for", "5m")
    assert acquire.returncode == 0, acquire.stderr
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("hyperqwen", "running")]
    _stop(world, probe, "gpuswapd.service")
    # Stopping the service gave the GPU back before gpuswapd exited.
    assert_resident_back(probe)
    assert sock.exists()  # RuntimeDirectoryPreserve=yes: the socket unit keeps its socket
    assert daemon.ctl("status").returncode == 0  # and starts the service again


def test_packaged_template_units_run_an_instance_in_the_test_world(built: Built, two_cards: Stack,
                                                                  probe: Probe) -> None:
    """gpuswapd@1.socket and gpuswapd@1.service from the package: GPU 1's gpuswapd, started by its socket."""
    world = two_cards
    sysusers = world.paths.root / "gpuswapd-sysusers.conf"
    sysusers.write_bytes(built.read("usr/lib/sysusers.d/gpuswapd.conf"))
    subprocess.run(["systemd-sysusers", str(sysusers)], check=True, capture_output=True, timeout=60)
    # No daemon.socket or daemon.state_dir: the instance's own are /run/gpuswapd/1.sock (inside the
    # world: STACKDIR/run/gpuswapd/1.sock) and $GPUSWAPD_STATE_ROOT/1 (here: in the world's directory,
    # where the previous run's state can be cleared, instead of the host's /var/lib/gpuswapd/1).
    config = stack_config(world, "packaged-instance", **instance_sections(world, "1", None, None))
    state_root = world.paths.root / "instances-state"
    shutil.rmtree(state_root, ignore_errors=True)
    env = world.env()
    world.install_unit("gpuswapd@.socket", built.read("usr/lib/systemd/system/gpuswapd@.socket").decode(),
                       {"test-world.conf": "[Unit]\nDefaultDependencies=no\n"})
    world.install_unit("gpuswapd@.service", built.read("usr/lib/systemd/system/gpuswapd@.service").decode(), {
        "test-world.conf": (
            "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\n"
            f"ExecStart={BIN}/gpuswapd --instance %i --config {config}\n"
            f"Environment=DOCKER_HOST={env['DOCKER_HOST']} PATH={env['PATH']} GPUSWAPD_STATE_ROOT={state_root}\n"
            # The venv's gpuswapd may be installed from another checkout: PYTHONPATH picks this one.
            + (f"Environment=PYTHONPATH={os.environ['PYTHONPATH']}\n" if os.environ.get("PYTHONPATH") else "")
            + f"BindPaths={world.paths.root}\n"
            f"BindReadOnlyPaths={REPO}\n"
        )})
    world.manager("StartUnit", "ss", "gpuswapd@1.socket", "replace")
    sock = world.paths.run / "gpuswapd" / "1.sock"
    daemon = RunningDaemon(world, config, sock, {"GPUSWAPD_RUNTIME_DIR": str(sock.parent)})
    daemon.env.pop("GPUSWAPD_SOCKET")  # gpuswapctl finds the socket by the instance's name
    assert probe.active_state("gpuswapd@1.socket") == "active"
    assert probe.active_state("gpuswapd@1.service") == "inactive"

    acquire = daemon.ctl("--instance", "1", "acquire", "--for", "5m", timeout=90)  # the socket starts the service
    assert acquire.returncode == 0, acquire.stderr
    assert probe.active_state("gpuswapd@1.service") == "active"
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("hyperqwen1", "running")]
    assert "io.gpuswapd.instance=1" in probe.containers()[0]["Labels"].split(",")
    assert probe.active_state(RESIDENT1) == "inactive"
    assert probe.states(["strata.service", "llama-swap.service"]) == dict.fromkeys(
        ["strata.service", "llama-swap.service"], "active")  # GPU 0's resident is not this instance's
    assert (state_root / "1" / "state.json").is_file()
    status = daemon.ctl_json("--instance", "1", "status")
    assert (status["instance"], status["gpu_index"], status["phase"]) == ("1", 1, "READY")

    _stop(world, probe, "gpuswapd@1.service")
    # Stopping the instance gave GPU 1 back to its resident before gpuswapd exited.
    assert probe.active_state(RESIDENT1) == "active"
    assert probe.containers() == []
    assert [h["name"] for h in world.ledger(1)["holders"] if h["dead_at"] is None] == ["strata1"]
    assert world.ooms() == []
    assert sock.exists()  # the socket unit keeps its socket, and starts the instance again
    assert daemon.ctl("--instance", "1", "status").returncode == 0
    world.manager("StopUnit", "ss", "gpuswapd@1.socket", "replace")


def _stop(world: Stack, probe: Probe, unit: str) -> None:
    """Stop a unit through systemd and wait until it is inactive."""
    world.manager("StopUnit", "ss", unit, "replace")
    deadline = time.monotonic() + 90
    while probe.active_state(unit) != "inactive":
        assert time.monotonic() < deadline, f"{unit} did not stop within 90s"
        time.sleep(0.1)


def _host_pid(world: Stack) -> int:
    """Translate the service's MainPID (namespace PID) into this process's PID namespace."""
    ns_pid = _main_pid(world)
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        nspid = next((ln.split()[1:] for ln in text.splitlines() if ln.startswith("NSpid:")), [])
        if len(nspid) > 1 and nspid[-1] == str(ns_pid) and "gpuswapd" in (status.parent / "cmdline").read_text():
            return int(nspid[0])
    raise AssertionError(f"no process with namespace PID {ns_pid}")
