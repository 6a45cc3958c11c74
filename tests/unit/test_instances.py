"""Instances: names, paths, the instance's configuration, gpuswapctl's choice of socket, status --all."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpuswapd import instances
from gpuswapd.ctl import main as ctl
from gpuswapd.ctl.client import DEFAULT_SOCKET, BadInstance, socket_path
from gpuswapd.errors import ConfigError
from tests.unit.conftest import MINIMAL


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the runtime and state roots at a scratch directory; no instance env."""
    monkeypatch.setenv(instances.RUNTIME_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(instances.STATE_ROOT_ENV, str(tmp_path / "lib"))
    for key in ("GPUSWAPD_SOCKET", "GPUSWAPD_INSTANCE"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "run").mkdir()
    return tmp_path


@pytest.mark.parametrize("name", ["0", "1", "a100-left", "gpu_2", "x" * 64])
def test_instance_names_that_are_taken(name: str) -> None:
    assert instances.check_name(name) == name


@pytest.mark.parametrize("name", ["default", "gpuswapd", "", "GPU0", "-1", "_a", "a.b", "a/b", "0 ", "x" * 65])
def test_instance_names_that_are_refused(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        instances.check_name(name)
    assert "--instance" in err.value.message


def test_paths_of_an_instance_and_of_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(instances.RUNTIME_DIR_ENV, raising=False)
    monkeypatch.delenv(instances.STATE_ROOT_ENV, raising=False)
    assert instances.socket_of("1") == "/run/gpuswapd/1.sock"
    assert instances.state_dir_of("1") == "/var/lib/gpuswapd/1"
    assert str(instances.config_path("1")) == "/etc/gpuswapd/instances/1.toml"
    assert instances.socket_of("default") == DEFAULT_SOCKET
    assert instances.state_dir_of("default") == "/var/lib/gpuswapd"


def _write(tmp_path: Path, daemon_table: str = "") -> Path:
    path = tmp_path / "1.toml"
    path.write_text(MINIMAL + ("\n[daemon]\n" + daemon_table if daemon_table else ""))
    return path


def test_an_instance_config_without_socket_and_state_gets_the_instances_own(dirs: Path) -> None:
    config = instances.load_instance_config(_write(dirs, 'linger = "5s"\n'), "1")
    assert config.daemon.socket == str(dirs / "run" / "1.sock")
    assert config.daemon.state_dir == str(dirs / "lib" / "1")
    assert config.daemon.linger == 5.0


def test_an_instance_config_may_name_its_own_socket_and_state(dirs: Path) -> None:
    table = f'socket = "{dirs}/run/1.sock"\nstate_dir = "{dirs}/lib/1/"\n'
    config = instances.load_instance_config(_write(dirs, table), "1")
    assert config.daemon.state_dir == str(dirs / "lib" / "1")


@pytest.mark.parametrize("key, value", [("socket", "/run/gpuswapd/gpuswapd.sock"), ("state_dir", "/var/lib/gpuswapd"),
                                        ("socket", "{dirs}/run/0.sock"), ("state_dir", "{dirs}/lib/0")])
def test_an_instance_config_naming_another_socket_or_state_is_refused(dirs: Path, key: str, value: str) -> None:
    path = _write(dirs, f'{key} = "{value.format(dirs=dirs)}"\n')
    with pytest.raises(ConfigError) as err:
        instances.load_instance_config(path, "1")
    assert f"daemon.{key}" in err.value.message and "instance 1" in err.value.message


def test_gpuswapd_refuses_bad_instances_and_foreign_paths_with_78(dirs: Path, daemon: ModuleType,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(dirs)
    assert daemon.main(["--instance", "default", "--config", str(good)]) == daemon.EX_CONFIG
    assert "plain gpuswapd.service" in capsys.readouterr().err
    assert daemon.main(["--instance", "Gpu0", "--config", str(good)]) == daemon.EX_CONFIG
    assert daemon.main(["--instance", "1", "--config", str(dirs / "missing.toml")]) == daemon.EX_CONFIG
    assert "no configuration for instance 1" in capsys.readouterr().err
    foreign = _write(dirs, 'socket = "/run/gpuswapd/gpuswapd.sock"\n')
    assert daemon.main(["--instance", "1", "--config", str(foreign)]) == daemon.EX_CONFIG
    assert "daemon.socket" in capsys.readouterr().err


def test_check_config_of_an_instance_warns_about_every_gpu_and_another_index(
        dirs: Path, daemon: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(dirs)  # gpus = "all" (the default), gpu.index = 0
    assert daemon.main(["--instance", "1", "--config", str(path), "--check-config"]) == 0
    err = capsys.readouterr().err
    assert 'window.container.gpus = "all"' in err and "reads GPU 0" in err
    # gpus = [1] for gpu.index = 1, and a volume for the compile caches (gpuswapd.checks.caches): no warning.
    path.write_text(MINIMAL.replace('image = "hyperqwen:latest"', 'image = "hyperqwen:latest"\ngpus = [1]\n'
                                    'volumes = { "/var/cache/hyperqwen" = "/root/.cache" }')
                    + "\n[gpu]\nindex = 1\n")
    assert daemon.main(["--instance", "1", "--config", str(path), "--check-config"]) == 0
    assert [line for line in capsys.readouterr().err.splitlines()
            if "warning" in line and "the card's memory cannot be read" not in line] == []


def test_the_daemon_labels_its_engines_with_its_instance(dirs: Path, daemon: ModuleType) -> None:
    config = instances.load_instance_config(_write(dirs), "1")
    d = daemon.Daemon(config, instance="1")
    assert d.engine.instance == "1"  # type: ignore[attr-defined]
    assert d.server.instance == "1"


# --- gpuswapctl: which socket -------------------------------------------------------------------

def test_socket_precedence(dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = dirs / "run"
    assert socket_path(None) == str(run / "gpuswapd.sock")
    monkeypatch.setenv("GPUSWAPD_INSTANCE", "2")
    assert socket_path(None) == str(run / "2.sock")
    monkeypatch.setenv("GPUSWAPD_SOCKET", "/env/socket")
    assert socket_path(None) == "/env/socket"
    assert socket_path(None, "1") == str(run / "1.sock")
    assert socket_path(None, "default") == str(run / "gpuswapd.sock")
    assert socket_path("/explicit", "1") == "/explicit"


def test_a_bad_instance_in_the_environment_is_a_usage_error(dirs: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUSWAPD_INSTANCE", "../etc")
    with pytest.raises(BadInstance):
        socket_path(None)
    assert ctl.main(["status"]) == ctl.EXIT_USAGE
    assert "GPUSWAPD_INSTANCE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        ctl.main(["status", "--instance", "../etc"])
    assert exit_.value.code == ctl.EXIT_USAGE


def test_instance_option_before_and_after_the_command(dirs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--instance", "3", "status"]) == ctl.EXIT_UNREACHABLE
    assert f"{dirs}/run/3.sock does not exist" in capsys.readouterr().err
    # What to do about a socket that is not there: start the socket unit that listens on it.
    for args, says in ((["--instance", "3"], "systemctl enable --now gpuswapd@3.socket"),
                       ([], "systemctl enable --now gpuswapd.socket"),
                       (["--socket", str(dirs / "elsewhere.sock")], "is gpuswapd running with daemon.socket = ")):
        assert ctl.main([*args, "status"]) == ctl.EXIT_UNREACHABLE
        assert says in capsys.readouterr().err
    assert ctl.main(["status", "--instance", "4"]) == ctl.EXIT_UNREACHABLE
    assert f"{dirs}/run/4.sock does not exist" in capsys.readouterr().err


# --- status --all -----------------------------------------------------------------------------

class StatusServer:
    """A socket that answers ``status`` like gpuswapd would (or never answers)."""

    def __init__(self, path: Path, reply: dict[str, object] | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.reply = reply
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.makefile("rb").readline()
            if self.reply is not None:
                conn.sendall(json.dumps(self.reply).encode() + b"\n")
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def _status(phase: str, index: int, holders: list[str]) -> dict[str, object]:
    leases = [{"id": f"l{i}", "holder": h, "remaining_s": 60.0} for i, h in enumerate(holders)]
    return {"ok": True, "phase": phase, "gpu_index": index, "queue": [],
            "window": {"id": "w1", "leases": leases} if leases else None}


@pytest.fixture
def servers(dirs: Path) -> Iterator[list[StatusServer]]:
    made: list[StatusServer] = []
    yield made
    for s in made:
        s.close()


def test_status_all_lists_every_instance_by_its_socket(dirs: Path, servers: list[StatusServer],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = dirs / "run"
    servers.append(StatusServer(run / "1.sock", _status("IDLE", 1, [])))
    servers.append(StatusServer(run / "0.sock", _status("READY", 0, ["train.service"])))
    # A gpuswapd from before instances says its GPU per profile only.
    servers.append(StatusServer(run / "gpuswapd.sock", {"ok": True, "phase": "IDLE", "window": None,
                                                        "profiles": {"default": {"gpu_index": 0}}}))
    (run / "notes.sock").write_text("not a socket")
    (run / "0.sock.lock").write_text("")
    assert ctl.main(["status", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["INSTANCE", "GPU", "PHASE", "LEASES", "SOCKET"]
    assert [ln.split()[:4] for ln in lines[1:]] == [
        ["default", "0", "IDLE", "0"], ["0", "0", "READY", "1"], ["1", "1", "IDLE", "0"]]
    assert "(train.service)" in lines[2]
    assert ctl.main(["status", "--all", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["instances"]
    assert [(i["instance"], i["ok"], i["phase"], i["gpu_index"]) for i in got] == [
        ("default", True, "IDLE", 0), ("0", True, "READY", 0), ("1", True, "IDLE", 1)]
    assert got[1]["leases"][0]["holder"] == "train.service"


def test_status_all_exits_3_naming_an_instance_that_did_not_answer(
        dirs: Path, servers: list[StatusServer], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuswapd.ctl import status_all

    monkeypatch.setattr(status_all, "ANSWER_TIMEOUT_S", 1.0)  # the hung one costs this
    run = dirs / "run"
    servers.append(StatusServer(run / "0.sock", _status("READY", 0, [])))
    servers.append(StatusServer(run / "1.sock", None))  # hangs
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(run / "2.sock"))
    dead.close()  # a socket file nobody listens on
    assert ctl.main(["status", "--all"]) == ctl.EXIT_UNREACHABLE
    captured = capsys.readouterr()
    assert [ln.split()[:3] for ln in captured.out.splitlines()[1:]] == [
        ["0", "0", "READY"], ["1", "-", "NO"], ["2", "-", "NO"]]
    assert "instance 1 did not answer" in captured.err and "instance 2 did not answer" in captured.err
    assert "instance 0" not in captured.err


def test_status_all_with_no_instance_at_all_exits_3(dirs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["status", "--all"]) == ctl.EXIT_UNREACHABLE
    assert f"no gpuswapd socket in {dirs / 'run'}" in capsys.readouterr().err


def test_status_all_takes_no_socket_or_instance(dirs: Path) -> None:
    for extra in (["--socket", "/x"], ["--instance", "1"]):
        with pytest.raises(SystemExit) as exit_:
            ctl.main(["status", "--all", *extra])
        assert exit_.value.code == ctl.EXIT_USAGE


def test_runtime_dir_defaults_to_run_gpuswapd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(instances.RUNTIME_DIR_ENV, raising=False)
    assert str(instances.runtime_dir()) == os.path.dirname(DEFAULT_SOCKET)


def test_gpuswapctl_does_not_load_the_daemons_configuration_or_logging() -> None:
    """The packaged gpuswapctl runs on a bare python: instance names must not pull in structlog."""
    import subprocess
    import sys

    code = "import sys, gpuswapd.ctl.main; print(sorted({'structlog', 'gpuswapd.config'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "[]"), proc.stderr
