"""The packaging: systemd units, man pages, shell completions, PKGBUILD (test_package.py builds it)."""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpuswapd import __version__, daemon, instances
from gpuswapd.config import DEFAULT_PATH, DaemonConfig, GatewayConfig
from gpuswapd.ctl import main as ctl
from gpuswapd.ctl.client import DEFAULT_SOCKET
from gpuswapd.errors import ConfigError
from gpuswapd.timespan import parse_span
from gpuswapd.window import driver

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "units"
MAN = ROOT / "packaging" / "man"
COMPLETIONS = ROOT / "packaging" / "completions"
ARCH = ROOT / "packaging" / "arch"
PAGES = {"gpuswapctl.1": 1, "gpuswapd.toml.5": 5, "gpuswapd.8": 8, "gpuswapd-gateway.8": 8}
SHELL_FILES = {"bash": "gpuswapctl.bash", "zsh": "_gpuswapctl", "fish": "gpuswapctl.fish"}
SECURITY_TARGET = 3.0
INSTANCE_SECURITY_TARGET = 2.1  # gpuswapd.service's exposure when the templates came
# What gpuswapd@.service may set differently from gpuswapd.service: the rest is the same hardening.
TEMPLATE_OWN = {("Unit", "Description"), ("Unit", "Requires"), ("Unit", "After"), ("Service", "ExecStart"),
                ("Service", "StateDirectory"), ("Service", "ConfigurationDirectory"), ("Install", "Also")}


def need(*tools: str) -> None:
    """Skip the test when a tool it runs is not installed (tests/run installs them all)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


# --- the command line, as build_parser() defines it -------------------------------------------

def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = ctl.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def top_options() -> set[str]:
    return options(ctl.build_parser())


def takes_remainder(parser: argparse.ArgumentParser) -> bool:
    return any(a.nargs == argparse.REMAINDER for a in parser._actions)


def exit_codes() -> dict[str, int]:
    return {name: value for name, value in vars(ctl).items() if name.startswith("EXIT_") and isinstance(value, int)}


def test_the_cli_is_what_these_tests_expect() -> None:
    subs = subcommands()
    assert {"acquire", "renew", "release", "run", "status", "plan", "history"} <= set(subs)
    assert takes_remainder(subs["run"])
    assert sorted(exit_codes().values()) == list(range(7))


# --- units ------------------------------------------------------------------------------------

def unit_settings(path: Path) -> dict[str, dict[str, list[str]]]:
    """Read a unit file: section -> key -> values (a key may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def one(settings: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = settings[section][key]
    assert len(values) == 1, f"[{section}] {key}= is set {len(values)} times"
    return values[0]


def test_service_runs_the_daemon_the_way_it_expects() -> None:
    s = unit_settings(UNITS / "gpuswapd.service")
    assert one(s, "Service", "Type") == "notify"
    assert one(s, "Service", "NotifyAccess") == "main"
    assert one(s, "Service", "ExecStart") == f"/usr/bin/gpuswapd --config {DEFAULT_PATH}"
    assert one(s, "Service", "Restart") == "on-failure"
    assert str(daemon.EX_CONFIG) in one(s, "Service", "RestartPreventExitStatus").split()
    assert parse_span(one(s, "Service", "WatchdogSec")) >= 10
    # The restore on stop is bounded by the daemon itself; systemd must not SIGKILL it before.
    assert parse_span(one(s, "Service", "TimeoutStopSec")) > daemon.SHUTDOWN_BOUND_S
    assert one(s, "Service", "StateDirectory") == "gpuswapd"
    assert one(s, "Service", "ConfigurationDirectory") == "gpuswapd"
    assert one(s, "Service", "RuntimeDirectory") == "gpuswapd"
    assert one(s, "Service", "RuntimeDirectoryPreserve") == "yes"
    assert one(s, "Service", "CapabilityBoundingSet") == ""
    assert "gpuswapd.socket" in one(s, "Unit", "Requires").split()
    assert "gpuswapd.socket" in one(s, "Install", "Also").split()
    # The config's state_dir default is where StateDirectory= puts it.
    assert DaemonConfig().state_dir == "/var/lib/gpuswapd"


@pytest.mark.parametrize("unit", ["gpuswapd.service", "gpuswapd@.service"])
def test_the_units_stop_timeout_outlasts_the_whole_bounded_shutdown(unit: str) -> None:
    # The close's bound from the signal, the window's time to stop where it is, the last write:
    # systemd must not SIGKILL gpuswapd before all three, with a margin for closing the rest.
    bounded = daemon.SHUTDOWN_BOUND_S + driver.SHUTDOWN_ABORT_S + daemon.WRITER_STOP_S
    stop = one(unit_settings(UNITS / unit), "Service", "TimeoutStopSec")
    assert parse_span(stop) >= bounded + 30, f"{unit}: TimeoutStopSec={stop} is not above {bounded:g} s + 30 s"
    # ...and the docs and gpuswapd(8) say the same numbers.
    readme, page = (ROOT / "docs" / "operating" / "systemd.md").read_text(), (MAN / "gpuswapd.8").read_text()
    for text in (readme, page):
        assert f"{bounded:g} s" in text and f"TimeoutStopSec={stop}" in text
    assert f"up to {daemon.SHUTDOWN_BOUND_S / 60:g} minutes from the SIGTERM" in readme


def test_socket_unit_sysusers_config_and_client_agree() -> None:
    s = unit_settings(UNITS / "gpuswapd.socket")
    group = one(s, "Socket", "SocketGroup")
    assert one(s, "Socket", "ListenStream") == DaemonConfig().socket == DEFAULT_SOCKET
    # status_public = true (the default) promises every local user status: the socket lets them
    # connect, and gpuswapd checks who may do more.
    assert DaemonConfig().status_public
    assert one(s, "Socket", "SocketMode") == "0666"
    assert one(s, "Install", "WantedBy") == "sockets.target"
    assert group == DaemonConfig().socket_group
    sysusers = [ln.split() for ln in (UNITS / "sysusers.d" / "gpuswapd.conf").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert ["g", group, "-"] in sysusers
    # The socket directory survives the service (RuntimeDirectory=gpuswapd, preserved).
    assert Path(DEFAULT_SOCKET).parent == Path("/run/gpuswapd")


def test_template_units_give_each_instance_its_own_config_socket_and_state() -> None:
    s = unit_settings(UNITS / "gpuswapd@.service")
    assert one(s, "Service", "ExecStart") == "/usr/bin/gpuswapd --instance %i"
    assert "gpuswapd@%i.socket" in one(s, "Unit", "Requires").split()
    assert "gpuswapd@%i.socket" in one(s, "Install", "Also").split()
    assert f"/var/lib/{one(s, 'Service', 'StateDirectory')}" == f"{instances.STATE_ROOT}/%i"
    assert f"/etc/{one(s, 'Service', 'ConfigurationDirectory')}" == instances.CONFIG_DIR
    assert f"/run/{one(s, 'Service', 'RuntimeDirectory')}" == instances.RUNTIME_DIR
    sock = unit_settings(UNITS / "gpuswapd@.socket")
    assert one(sock, "Socket", "ListenStream") == f"{instances.RUNTIME_DIR}/%i.sock"
    assert str(instances.config_path("%i")) == f"{instances.CONFIG_DIR}/%i.toml"
    plain = unit_settings(UNITS / "gpuswapd.socket")
    assert {k: v for k, v in sock["Socket"].items() if k != "ListenStream"} == \
        {k: v for k, v in plain["Socket"].items() if k != "ListenStream"}


@pytest.mark.parametrize("section", ["Unit", "Service", "Install"])
def test_template_service_has_the_same_hardening_as_the_plain_one(section: str) -> None:
    template, plain = unit_settings(UNITS / "gpuswapd@.service"), unit_settings(UNITS / "gpuswapd.service")
    mine = {k: v for k, v in template[section].items() if (section, k) not in TEMPLATE_OWN}
    theirs = {k: v for k, v in plain[section].items() if (section, k) not in TEMPLATE_OWN}
    assert mine == theirs


def test_systemd_analyze_verify_passes_on_the_units(tmp_path: Path) -> None:
    need("systemd-analyze", "man")
    # A root laid out like the installed package: the host's units (for sysinit.target and
    # friends), ours unchanged, a stand-in /usr/bin/gpuswapd for the ExecStart= check, and our man
    # pages on MANPATH for the Documentation= check.
    root = tmp_path / "root"
    unit_dir = root / "usr/lib/systemd/system"
    shutil.copytree("/usr/lib/systemd/system", unit_dir, symlinks=True)
    for name in ("gpuswapd.service", "gpuswapd.socket", "gpuswapd@.service", "gpuswapd@.socket",
                 "gpuswapd-gateway.service", "gpuswapd-gateway.socket"):
        shutil.copy(UNITS / name, unit_dir / name)
    for binary in ("gpuswapd", "gpuswapd-gateway"):
        stub = root / "usr/bin" / binary
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    manpath = tmp_path / "man"
    for page, section in PAGES.items():
        (manpath / f"man{section}").mkdir(parents=True, exist_ok=True)
        shutil.copy(MAN / page, manpath / f"man{section}" / page)
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "gpuswapd.service", "gpuswapd.socket",
         "gpuswapd@0.service", "gpuswapd@0.socket", "gpuswapd-gateway.service", "gpuswapd-gateway.socket"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "MANPATH": str(manpath)},
    )
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


EXAMPLES = UNITS / "examples"


@pytest.mark.parametrize("layout", [("strata.service", "llama-swap.service"), ("llama-swap-cmd/llama-swap.service",)],
                         ids=["strata-under-llama-swap", "llama-swap-runs-llama-server"])
def test_systemd_analyze_verify_passes_on_the_example_units_and_the_lease_drop_in(
        tmp_path: Path, layout: tuple[str, ...]) -> None:
    need("systemd-analyze")
    # The host's units, ours, the examples as an operator copies them to /etc/systemd/system, a
    # consumer service with the shipped lease drop-in, and stand-ins for the binaries they run.
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    for name in ("gpuswapd.service", "gpuswapd.socket"):
        shutil.copy(UNITS / name, root / "usr/lib/systemd/system" / name)
    etc = root / "etc/systemd/system"
    (etc / "my-eval.service.d").mkdir(parents=True)
    for example in layout:
        shutil.copy(EXAMPLES / example, etc / Path(example).name)
    (etc / "my-eval.service").write_text("[Service]\nExecStart=/usr/bin/my-eval\n")
    shutil.copy(EXAMPLES / "gpuswap-lease.conf", etc / "my-eval.service.d" / "gpuswap-lease.conf")
    for binary in ("gpuswapd", "gpuswapctl", "llama-server", "llama-swap", "my-eval"):
        stub = root / "usr/bin" / binary
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    units = [Path(example).name for example in layout]
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", *units, "my-eval.service"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_systemd_analyze_verify_notices_a_missing_binary(tmp_path: Path) -> None:
    """The verify above would catch an ExecStart= that does not exist (no false comfort)."""
    need("systemd-analyze")
    root = tmp_path / "root"
    unit_dir = root / "usr/lib/systemd/system"
    shutil.copytree("/usr/lib/systemd/system", unit_dir, symlinks=True)
    shutil.copy(UNITS / "gpuswapd.service", unit_dir)
    shutil.copy(UNITS / "gpuswapd.socket", unit_dir)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", "gpuswapd.service"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "/usr/bin/gpuswapd is not executable" in proc.stderr


def exposure(unit: str, root: Path | None = None) -> float:
    """Score a unit with ``systemd-analyze security --offline=yes`` (a file, or a unit under ``root``)."""
    where = [f"--root={root}", unit] if root else [str(UNITS / unit)]
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", *where],
                          capture_output=True, text=True, timeout=60)
    m = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+(?:\.\d+)?)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return float(m.group(1))


def test_security_exposure_is_at_most_the_target() -> None:
    need("systemd-analyze")
    assert exposure("gpuswapd.service") <= SECURITY_TARGET


def syscall_groups() -> dict[str, set[str]]:
    """Read systemd's system call groups (``systemd-analyze syscall-filter``), each expanded to its calls."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    raw: dict[str, list[str]] = {}
    group = ""
    for line in out.splitlines():
        word = line.strip().split(" ")[0] if line.strip() else ""
        if line.startswith("@"):
            group = line.split()[0]
            raw[group] = []
        elif group and word and not word.startswith("#"):
            raw[group].append(word)

    def expand(name: str) -> set[str]:
        return set().union(*(expand(n) if n.startswith("@") else {n} for n in raw.get(name, [])))

    return {name: expand(name) for name in raw}


def allowed_syscalls(unit: str) -> set[str]:
    """Apply a unit's SystemCallFilter= lines in order: the first allow list, then what each adds or takes away."""
    groups = syscall_groups()
    allowed: set[str] = set()
    for line in unit_settings(UNITS / unit)["Service"]["SystemCallFilter"]:
        deny = line.startswith("~")
        names = set().union(*(groups[w] if w.startswith("@") else {w} for w in line.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    return allowed


@pytest.mark.parametrize("unit", ["gpuswapd.service", "gpuswapd@.service"])
def test_the_system_call_filter_lets_gpuswapd_measure_and_read_the_resident_files(unit: str) -> None:
    need("systemd-analyze")
    allowed = allowed_syscalls(unit)
    # mincore: what of a file is in the page cache; fadvise64 and pread64/preadv: reading it in.
    assert {"mincore", "fadvise64", "readahead", "pread64", "preadv", "mmap", "munmap"} <= allowed
    assert "reboot" not in allowed and "setrlimit" not in allowed  # ~@privileged @resources still hold
    assert "mincore" not in syscall_groups()["@system-service"], "drop the explicit mincore line"


def test_the_gateway_unit_is_hardened_socket_activated_and_never_restarts() -> None:
    need("systemd-analyze")
    assert exposure("gpuswapd-gateway.service") <= SECURITY_TARGET
    s = unit_settings(UNITS / "gpuswapd-gateway.service")
    # A restart policy would keep a crashed gateway "activating (auto-restart)": never inactive, so
    # gpuswapd would never end its leases. The socket starts it again instead.
    assert "Restart" not in s["Service"]
    assert one(s, "Unit", "Requires") == "gpuswapd-gateway.socket"
    assert one(s, "Service", "SupplementaryGroups") == "gpuswap"  # may acquire (daemon.socket_group)
    sock = unit_settings(UNITS / "gpuswapd-gateway.socket")
    assert one(sock, "Socket", "ListenStream") == GatewayConfig().listen
    # A preemption revokes the gateway's leases but never stops its units.
    assert {"gpuswapd-gateway.service", "gpuswapd-gateway.socket"} <= set(DaemonConfig().never_stop)


def test_gateway_page_covers_every_option_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuswapd.gateway import main as gateway_main

    text = page_text("gpuswapd-gateway.8")
    with pytest.raises(SystemExit):
        gateway_main.main(["--help"])
    found = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", capsys.readouterr().out))
    assert {"--config", "--socket", "--check-config", "--log-level", "--version", "--help"} <= found
    opts = section(text, "OPTIONS")
    for opt in found:
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", opts), f"OPTIONS: {opt}"
    status = section(text, "EXIT STATUS")
    for code in (0, 1, 2, gateway_main.EX_CONFIG):
        assert re.search(rf"^\.B {code}$", status, re.M), f"EXIT STATUS lacks {code}"
    for word in ("bind", "Retry-After", "never_stop", "Restart=", "LISTEN_FDS", "8090", "kind = \"gateway\""):
        assert word in text, f"gpuswapd-gateway(8) lacks {word}"


def test_security_exposure_of_an_instance_is_at_most_the_plain_units(tmp_path: Path) -> None:
    need("systemd-analyze")
    unit_dir = tmp_path / "usr/lib/systemd/system"
    unit_dir.mkdir(parents=True)
    for name in ("gpuswapd@.service", "gpuswapd@.socket"):
        shutil.copy(UNITS / name, unit_dir / name)
    score = exposure("gpuswapd@0.service", tmp_path)
    assert score <= INSTANCE_SECURITY_TARGET
    assert score <= exposure("gpuswapd.service")


def test_sysusers_and_tmpfiles_do_what_they_say(tmp_path: Path) -> None:
    need("systemd-sysusers", "systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles sets owners: needs root")
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(UNITS / "sysusers.d" / "gpuswapd.conf")],
                   check=True, capture_output=True, timeout=30)
    assert re.search(r"^gpuswap:x:\d+:", (tmp_path / "etc" / "group").read_text(), re.M)
    subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(UNITS / "tmpfiles.d" / "gpuswapd.conf")],
                   check=True, capture_output=True, timeout=30)
    assert (tmp_path / "var/lib/gpuswapd").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "run/gpuswapd").is_dir()
    slots = (tmp_path / "var/cache/gpuswapd/slots").stat()
    assert slots.st_mode & 0o7777 == 0o2770 and slots.st_uid == 0
    assert re.search(rf"^gpuswap-slots:x:{slots.st_gid}:", (tmp_path / "etc" / "group").read_text(), re.M)


# --- man pages --------------------------------------------------------------------------------

def page_text(name: str) -> str:
    """The page's roff source with minus signs and font changes undone, for searching."""
    text = (MAN / name).read_text()
    return re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\(dq", '"').replace("\\&", "")


def section(text: str, title: str) -> str:
    m = re.search(rf"^\.SH {re.escape(title)}\n(.*?)(?=^\.SH |\Z)", text, re.S | re.M)
    assert m, f"no section {title}"
    return m.group(1)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_man_page_renders_without_warnings(page: str) -> None:
    need("groff", "man")
    groff = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN / page)], capture_output=True, text=True, timeout=30)
    assert groff.returncode == 0 and groff.stderr == "", groff.stderr
    man = subprocess.run(["man", "--warnings", "-l", str(MAN / page)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "MANPAGER": "cat", "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})
    assert man.returncode == 0 and man.stderr == "", man.stderr
    assert "NAME" in man.stdout


@pytest.mark.parametrize("page", sorted(PAGES))
def test_man_page_names_this_version(page: str) -> None:
    th = next(ln for ln in (MAN / page).read_text().splitlines() if ln.startswith(".TH "))
    assert f'"gpuswapd {__version__}"' in th
    assert f" {PAGES[page]} " in th


def test_gpuswapctl_page_covers_every_command_option_and_exit_code() -> None:
    text = page_text("gpuswapctl.1")
    synopsis, commands = section(text, "SYNOPSIS"), section(text, "COMMANDS")
    for name, parser in subcommands().items():
        line = re.search(rf"^\.B gpuswapctl {name}\n(.*?)(?=^\.br|^\.PP|\Z)", synopsis, re.S | re.M)
        assert line, f"SYNOPSIS lacks {name}"
        entry = re.search(rf"^\.TP\n\.B {name}\n(.*?)(?=^\.TP\n\.B [a-z]+\n|\Z)", commands, re.S | re.M)
        assert entry, f"COMMANDS lacks {name}"
        for opt in options(parser) - top_options():
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", line.group(1)), f"SYNOPSIS: {name} {opt}"
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", entry.group(1)), f"COMMANDS: {name} {opt}"
        if takes_remainder(parser):
            assert re.search(r"(?<![\w-])--(?![\w-])", line.group(1)), f"SYNOPSIS: {name} --"
    opts = section(text, "OPTIONS")
    for opt in top_options():
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", opts), f"OPTIONS: {opt}"
    status = section(text, "EXIT STATUS")
    for name, code in exit_codes().items():
        assert re.search(rf"^\.B {code}$", status, re.M), f"EXIT STATUS lacks {code} ({name})"
    environment = section(text, "ENVIRONMENT")
    for name in ("GPUSWAPD_SOCKET", "GPUSWAPD_INSTANCE", "GPUSWAPD_RUNTIME_DIR"):
        assert name in environment, f"ENVIRONMENT lacks {name}"
    # The precedence of the ways to name the socket, as socket_path() applies it.
    assert re.search(r"--socket.*--instance.*GPUSWAPD_SOCKET.*GPUSWAPD_INSTANCE", environment, re.S)


def daemon_options(capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        daemon.main(["--help"])
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", capsys.readouterr().out))


def test_gpuswapd_page_covers_every_option_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    text = page_text("gpuswapd.8")
    found = daemon_options(capsys)
    assert {"--config", "--check-config", "--log-level", "--version", "--help"} <= found
    opts = section(text, "OPTIONS")
    for opt in found:
        assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", opts), f"OPTIONS: {opt}"
    status = section(text, "EXIT STATUS")
    for code in (0, 1, 2, daemon.EX_CONFIG):
        assert re.search(rf"^\.B {code}$", status, re.M), f"EXIT STATUS lacks {code}"
    for word in ("READY=1", "STATUS=", "WATCHDOG=1", "LISTEN_FDS", "SIGTERM", str(DEFAULT_PATH)):
        assert word in text
    for word in ("gpuswapd@", instances.CONFIG_DIR, instances.RUNTIME_DIR_ENV, instances.STATE_ROOT_ENV,
                 "io.gpuswapd.instance"):
        assert word in text, f"gpuswapd(8) lacks {word}"


def config_keys_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_keys", MAN / "config_keys.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toml_page_names_every_config_key() -> None:
    keys = config_keys_module()
    text = page_text("gpuswapd.toml.5")
    body = section(text, "KEYS")
    dotted = [name for name, _ in keys.all_keys()]
    assert len(dotted) > 40
    for name in dotted:
        table, _, key = name.rpartition(".")
        block = re.search(rf'^\.SS "\[{re.escape(table)}\]"\n(.*?)(?=^\.SS |\Z)', body, re.S | re.M)
        assert block, f"no [{table}] in gpuswapd.toml(5)"
        assert re.search(rf"^{re.escape(key)} \(", block.group(1), re.M), f"gpuswapd.toml(5) lacks {name}"


def test_toml_page_is_what_the_generator_writes() -> None:
    keys = config_keys_module()
    page = (MAN / "gpuswapd.toml.5").read_text()
    assert keys.render_page(page) == page, "run: python packaging/man/config_keys.py --write"


def test_the_shipped_config_sets_nothing_and_says_what_to_set() -> None:
    """/etc/gpuswapd/gpuswapd.toml as installed starts nothing: gpuswapd names the keys to set."""
    from gpuswapd.config import load_config

    with pytest.raises(ConfigError, match=r"resident: not configured: .*resident\.units"):
        load_config(UNITS / "gpuswapd.toml")


# --- shell completions ------------------------------------------------------------------------

@pytest.mark.parametrize("shell", sorted(SHELL_FILES))
def test_completion_mentions_every_command_and_option(shell: str) -> None:
    text = (COMPLETIONS / SHELL_FILES[shell]).read_text()
    words = set(re.findall(r"[A-Za-z][\w-]*", text))
    for name, parser in subcommands().items():
        assert name in words, f"{shell}: {name}"
        for opt in options(parser):
            bare = opt.lstrip("-")
            assert re.search(rf"(?<![\w-])(-{{1,2}}|-l |-s ){re.escape(bare)}(?![\w-])", text), f"{shell}: {name} {opt}"
    assert re.search(r"(?<![\w-])--(?![\w-])", text), f"{shell}: -- for run"


BASH_HARNESS = r"""
source /usr/share/bash-completion/bash_completion
source "$1"
line=$2
read -ra COMP_WORDS <<< "$line"
[[ $line == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMP_LINE=$line; COMP_POINT=${#line}
_gpuswapctl gpuswapctl "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}" 2>/dev/null
printf '%s\n' "${COMPREPLY[@]}"
"""

# zsh completes only in an interactive shell: drive one through a pseudo-terminal (zsh/zpty), record
# what compadd is given, and stop after the first completion. No compinit dump file (-D).
ZSH_HARNESS = r"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "fpath=(${(q)1} \$fpath); autoload -Uz compinit; compinit -u -D"
zpty -w z 'compadd () {
  if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; return $?; fi
  typeset -a __hits; builtin compadd -A __hits "$@"
  local h; for h in $__hits; do print -r -- "<<MA""TCH:$h>>"; done
  builtin compadd "$@"
}'
zpty -w z 'done-line () { print -r -- "<<DO""NE>>" }'
zpty -w z 'comppostfuncs=( done-line exit )'
zpty -w z "bindkey '^I' complete-word"
zpty -w z "$2"$'\t'
local all="" chunk
integer tries=0
while (( tries++ < 400 )); do
  if zpty -r -t z chunk 2>/dev/null; then
    all+=$chunk
    [[ $all == *'<<DONE>>'* ]] && break
  else
    sleep 0.05
  fi
done
print -rl -- ${(ou)${${(M)${(f)all}:#*<<MATCH:*}#*<<MATCH:}%%>>*}
zpty -d z
"""


@pytest.fixture
def shell_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {"HOME": str(home), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "TERM": "dumb",
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share")}


def complete(shell: str, line: str, env: dict[str, str], tmp_path: Path) -> set[str]:
    """Return what ``shell`` offers for ``line`` with our completion file loaded."""
    if shell == "bash":
        if not Path("/usr/share/bash-completion/bash_completion").exists():
            pytest.skip("bash-completion is not installed")
        harness = tmp_path / "complete.bash"
        harness.write_text(BASH_HARNESS)
        argv = ["bash", "--norc", "--noprofile", str(harness), str(COMPLETIONS / SHELL_FILES["bash"]), line]
    elif shell == "zsh":
        need("zsh")
        fpath = tmp_path / "zfunc"
        fpath.mkdir(exist_ok=True)
        shutil.copy(COMPLETIONS / SHELL_FILES["zsh"], fpath / "_gpuswapctl")
        harness = tmp_path / "complete.zsh"
        harness.write_text(ZSH_HARNESS)
        argv = ["zsh", "-f", str(harness), str(fpath), line]
    else:
        need("fish")
        quoted = line.replace("\\", "\\\\").replace("'", "\\'")
        argv = ["fish", "--no-config", "-c", f"source {COMPLETIONS / SHELL_FILES['fish']}; complete -C '{quoted}'"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return {ln.split("\t")[0] for ln in proc.stdout.splitlines() if ln.strip()}


@pytest.mark.parametrize("shell", sorted(SHELL_FILES))
def test_completion_offers_the_commands(shell: str, shell_env: dict[str, str], tmp_path: Path) -> None:
    offered = complete(shell, "gpuswapctl ", shell_env, tmp_path)
    assert set(subcommands()) <= offered


@pytest.mark.parametrize("shell", sorted(SHELL_FILES))
def test_completion_offers_exactly_the_options_of_each_command(
        shell: str, shell_env: dict[str, str], tmp_path: Path) -> None:
    for name, parser in subcommands().items():
        expected = {o for o in options(parser) if o.startswith("--")}
        if takes_remainder(parser):
            expected.add("--")
        offered = complete(shell, f"gpuswapctl {name} --", shell_env, tmp_path)
        assert offered == expected, f"{shell}: gpuswapctl {name} --"


@pytest.mark.parametrize("shell", sorted(SHELL_FILES))
def test_completion_offers_the_instances_by_their_sockets(
        shell: str, shell_env: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    made = []
    for name in ("0.sock", "1.sock", "gpuswapd.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(run / name))
        made.append(s)
    (run / "notes.sock").write_text("not a socket")
    try:
        offered = complete(shell, "gpuswapctl status --instance ", {**shell_env, "GPUSWAPD_RUNTIME_DIR": str(run)},
                           tmp_path)
    finally:
        for s in made:
            s.close()
    assert offered == {"0", "1", "default"}


@pytest.mark.parametrize("shell", sorted(SHELL_FILES))
def test_completion_after_run_dashdash_completes_the_command(
        shell: str, shell_env: dict[str, str], tmp_path: Path) -> None:
    assert "echo" in complete(shell, "gpuswapctl run --for 1h -- ech", shell_env, tmp_path)
    assert {"15m", "1h"} <= complete(shell, "gpuswapctl run --for ", shell_env, tmp_path)


# --- PKGBUILD ---------------------------------------------------------------------------------

def pkgbuild_var(name: str) -> str:
    m = re.search(rf"^{name}=(\S+)$", (ARCH / "PKGBUILD").read_text(), re.M)
    assert m, f"PKGBUILD sets no {name}="
    return m.group(1).strip("'\"")


def test_pkgbuild_version_is_the_package_version() -> None:
    assert pkgbuild_var("pkgver") == __version__


@pytest.fixture
def builder_dir() -> Iterator[tuple[list[str], Path]]:
    """A scratch directory outside /tmp and a command prefix that runs makepkg as a non-root user."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="gpuswapd-srcinfo.") as d:
        scratch = Path(d)
        if os.geteuid() == 0:
            shutil.chown(scratch, "nobody")
            yield ["runuser", "-u", "nobody", "--"], scratch
        else:
            yield [], scratch


def test_srcinfo_matches_the_pkgbuild(builder_dir: tuple[list[str], Path]) -> None:
    need("makepkg")
    prefix, scratch = builder_dir
    # makepkg looks pacman up even for --printsrcinfo; PACMAN= names it (here: a no-op).
    env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "PACMAN": "true", "LC_ALL": "C.UTF-8",
           **{k: str(scratch) for k in ("BUILDDIR", "PKGDEST", "SRCDEST", "SRCPKGDEST", "LOGDEST")}}
    proc = subprocess.run([*prefix, "env", "-i", *(f"{k}={v}" for k, v in env.items()), "makepkg", "--printsrcinfo"],
                          cwd=ARCH, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ARCH / ".SRCINFO").read_text(), "run: makepkg --printsrcinfo > .SRCINFO"


def test_build_script_is_executable_bash() -> None:
    script = ARCH / "build.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


# /proc/devices of NVIDIA's drivers, as they register their character devices.
CURRENT_DRIVER = {"195": ["nvidia", "nvidiactl"], "234": ["nvidia-caps"], "509": ["nvidia-uvm"]}
OLD_MULTI_MODULE_DRIVER = {"195": ["nvidia-frontend"], "246": ["nvidia-caps"]}


def _allowed(names: list[str], patterns: list[tuple[str, str]], access: str) -> list[str]:
    """Match device group names the way systemd does: char-GLOB against /proc/devices."""
    return [name for name in names
            if any(fnmatch.fnmatchcase(name, glob) and set(access) <= set(perm) for glob, perm in patterns)]


@pytest.mark.parametrize("devices", [CURRENT_DRIVER, OLD_MULTI_MODULE_DRIVER], ids=["current", "multi-module"])
def test_device_allow_lets_nvml_open_the_gpu_on_current_and_old_drivers(devices: dict[str, list[str]]) -> None:
    s = unit_settings(UNITS / "gpuswapd.service")
    assert one(s, "Service", "DevicePolicy") == "closed"
    patterns = []
    for entry in s["Service"]["DeviceAllow"]:
        spec, perm = entry.split()
        assert spec.startswith("char-"), entry
        patterns.append((spec.removeprefix("char-"), perm))
    # NVML opens /dev/nvidiactl and /dev/nvidiaN read-write: both are major 195.
    assert _allowed(devices["195"], patterns, "rw") == devices["195"]
    caps = [name for names in devices.values() for name in names if name == "nvidia-caps"]
    assert _allowed(caps, patterns, "r") == caps


def test_the_unit_leaves_room_for_the_connection_caps() -> None:
    s = unit_settings(UNITS / "gpuswapd.service")
    d = DaemonConfig()
    assert int(one(s, "Service", "LimitNOFILE")) >= 4 * (d.max_clients + 256)


# --- the known-bad table: package data, documented ---------------------------------------------

def test_a_fresh_virtualenv_install_finds_the_known_bad_table(tmp_path: Path) -> None:
    """A wheel of this checkout, installed into a new virtualenv, carries the table as package data."""
    from gpuswapd.checks import knownbad

    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels),
                            str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    [wheel] = wheels.glob("gpuswapd-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    install = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    # Out of the checkout (cwd), without the test layer's table: only what the wheel installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", knownbad.SHIPPED_ENV)}
    code = ("import json; from gpuswapd.checks import knownbad; t = knownbad.load_table(); "
            "print(json.dumps([knownbad.__file__, t.files, t.ids]))")
    proc = subprocess.run([str(venv / "bin/python"), "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={**env, knownbad.DIR_ENV: str(tmp_path / "no-rows")})
    assert proc.returncode == 0, proc.stderr
    module, files, ids = json.loads(proc.stdout)
    assert module.startswith(str(venv)), module
    if not knownbad.SHIPPED.exists():  # a host with the Arch package reads /usr/share's copy first
        [data] = files
        assert data.startswith(str(venv)) and data.endswith("gpuswapd/data/known-bad.toml")
        assert Path(data).read_bytes() == (ROOT / "gpuswapd" / knownbad.PACKAGE_DATA).read_bytes()
    assert ids == knownbad.load_table((str(ROOT / "gpuswapd" / knownbad.PACKAGE_DATA),
                                       (ROOT / "gpuswapd" / knownbad.PACKAGE_DATA).read_text()),
                                      tmp_path / "no-rows").ids


def test_toml_page_documents_every_shipped_known_bad_row() -> None:
    from gpuswapd.checks import knownbad

    path = ROOT / "gpuswapd" / knownbad.PACKAGE_DATA
    rows = knownbad.parse_rows(path.read_text(), str(path))
    text = page_text("gpuswapd.toml.5")
    body = section(text, "KNOWN-BAD SETTINGS")
    shipped = body.partition('.SS "The shipped rows"')[2]
    assert shipped, "gpuswapd.toml(5) has no \"The shipped rows\" in KNOWN-BAD SETTINGS"
    documented = re.findall(r"^\.TP\n\.B (\S+)$", shipped, re.M)
    assert documented == [r.id for r in rows]
    for row in rows:
        entry = shipped.split(f".B {row.id}\n", 1)[1].split(".TP", 1)[0]
        plain = re.sub(r"\s+", " ", entry.replace("\n.B ", " "))
        assert f"refuse = {'true' if row.refuse else 'false'}" in plain, row.id
        assert row.reason in plain, f"{row.id}: the page does not give its reason as the table does"
