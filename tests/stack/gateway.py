"""Run the real gpuswapd-gateway against the test world: as a process of its own, or as its shipped units.

As a process (``RunningGateway``), its leases carry the holder ``gpuswapd-gateway[PID]`` and are
bound to their connections only: killing it ends them. As the shipped units in the world's systemd
(``install_units``), the socket unit holds 127.0.0.1:8080 and starts the service on the first
connection; its leases are then bound to gpuswapd-gateway.service as well.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.world import GATEWAY_PORT, REPO, Stack, StackError

URL = f"http://127.0.0.1:{GATEWAY_PORT}"
SYSTEM_PYTHON = "/usr/bin/python3"


def gateway_sections(**gateway: Any) -> dict[str, dict[str, Any]]:
    """Config sections for ``stack_config``/the ``gpuswapd`` fixture: the gateway, serves, the drain probe."""
    return {
        "gateway": {"listen": f"127.0.0.1:{GATEWAY_PORT}", "idle": "2s", "hold": "90s", **gateway},
        "window": {"serves": ["hyperqwen"]},
        "resident__idle": {"kind": "gateway"},
    }


def get(path: str, timeout: float = 10) -> tuple[int, Any, dict[str, str]]:
    """GET from the gateway; return the status, the JSON body and the headers."""
    return request("GET", path, None, timeout)


def request(method: str, path: str, body: Any, timeout: float = 120,
            raw: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
    """Send a request to the gateway (``raw``: bytes as they are); return the status, JSON body and headers."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(URL + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read()
            status, headers = resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        text, status, headers = err.read(), err.code, dict(err.headers)
    try:
        return status, json.loads(text), headers
    except ValueError:
        return status, text.decode(errors="replace"), headers


class RunningGateway:
    """A gpuswapd-gateway process with a daemon's configuration."""

    def __init__(self, daemon: RunningDaemon, config: Path | None = None) -> None:
        self.daemon = daemon
        self.config = config or daemon.config
        self.log = self.config.with_name(self.config.stem + "-gateway.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RunningGateway:
        """Start it and wait until it answers /health."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(BIN / "gpuswapd-gateway"), "--config", str(self.config),
                                          "--socket", str(self.daemon.socket)],
                                         env={**self.daemon.env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                status, health, _ = get("/health", timeout=2)
                if status == 200 and health.get("gpuswapd"):
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise StackError(f"gpuswapd-gateway exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise StackError(f"gpuswapd-gateway did not answer within 30s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        """Return the end of its log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL it (a crash)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """Stop it as systemd does (SIGTERM), or kill it if it does not go."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(45)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def install_units(world: Stack, config: Path, socket: Path) -> None:
    """Install the shipped gateway units in the world's systemd, pointed at this checkout and ``config``.

    The drop-in changes only what the world needs: the interpreter and this checkout's packages
    (the venv's python is a link into /root, which the unit's DynamicUser= may not enter: the
    system's python 3.11 runs the venv's packages instead), the daemon's socket, and the paths the
    sandbox must see. Everything else, DynamicUser= and SupplementaryGroups=gpuswap among it, runs
    as shipped.
    """
    site = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
    for name in ("gpuswapd-gateway.socket", "gpuswapd-gateway.service"):
        text = (REPO / "units" / name).read_text()
        dropin = "[Unit]\nDefaultDependencies=no\n"
        if name.endswith(".service"):
            dropin += (
                "[Service]\nExecStart=\n"
                f"ExecStart={SYSTEM_PYTHON} -m gpuswapd.gateway.main --config {config} --socket {socket}\n"
                f"Environment=PYTHONPATH={REPO}:{site} PYTHONUNBUFFERED=1\n"
                f"BindReadOnlyPaths={world.paths.root} {REPO}\n"
                f"StandardOutput=append:{world.paths.logs}/gpuswapd-gateway.log\nStandardError=inherit\n"
            )
        world.install_unit(name, text, {"test-world.conf": dropin})
