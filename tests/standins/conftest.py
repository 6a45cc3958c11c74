"""Helpers for the tests of the world's stand-ins (tests/stack/standins): each runs as a subprocess, killed by PID."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SIM = Path(__file__).resolve().parents[1] / "stack" / "standins"
# The simulators must run on the interpreter the test world gives them.
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
GiB = 1 << 30


def load_sim(name: str) -> ModuleType:
    """Import a sim module under a private name (no sys.path changes)."""
    spec = importlib.util.spec_from_file_location(f"gpusim_{name}", SIM / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ledger = load_sim("ledger")


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(
    port: int, method: str, path: str, body: Any = None, timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to 127.0.0.1:port; returns status, headers, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def wait_until(check: Any, timeout: float = 5.0, step: float = 0.02) -> Any:
    """Poll ``check()`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        time.sleep(step)


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def sse_events(raw: bytes) -> list[Any]:
    """Decode a server-sent event stream into JSON objects (``[DONE]`` kept as a string)."""
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class Procs:
    """Subprocesses started by a test; all killed by PID at teardown."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self, script: str, *args: str, env: dict[str, str] | None = None, name: str = ""
    ) -> subprocess.Popen[bytes]:
        """Run ``sim/SCRIPT`` with the test interpreter; output goes to a log file."""
        log = self.logdir / f"{name or script}-{len(self.started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [PY, str(SIM / script), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        proc.log = log  # type: ignore[attr-defined]
        self.started.append(proc)
        return proc

    def start_argv(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Run any command line; output goes to a log file."""
        log = self.logdir / f"argv-{len(self.started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        """Kill what is still running, by PID."""
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Start subprocesses; they are killed when the test ends."""
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def gpusim(tmp_path: Path) -> Path:
    """A fresh 24 GiB ledger with a 0.5 s release lag."""
    d = tmp_path / "gpu"
    ledger.init(d, 24 * GiB, 0.5)
    return d


# Taken now: pytest re-imports every directory's conftest under the same module name.
_THIS = sys.modules[__name__]


@pytest.fixture
def kit() -> ModuleType:
    """These helpers, for the tests (a conftest cannot be imported by name reliably)."""
    return _THIS
