"""Run the real gpuswapd and gpuswapctl against the test world (tests, demo, benchmarks)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from tests.stack.world import Stack, StackError

BIN = Path(sys.executable).parent


class RunningDaemon:
    """A gpuswapd process started with a config for the stack."""

    def __init__(self, stack: Stack, config: Path, socket: Path, env: dict[str, str] | None = None,
                 args: list[str] | None = None, prefix: list[str] | None = None,
                 program: list[str] | None = None) -> None:
        self.stack = stack
        self.config = config
        self.args = args or []  # more of gpuswapd's options, e.g. ["--instance", "1"]
        self.prefix = prefix or []  # what gpuswapd runs under, e.g. setpriv to drop its capabilities
        # gpuswapd itself, or a launcher that runs it (tests.stack.nvml: NVML answered from the ledger)
        self.program = program or [str(BIN / "gpuswapd")]
        self.socket = socket
        self.env = {**os.environ, **stack.env(), "GPUSWAPD_SOCKET": str(socket), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.log = config.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True, env: dict[str, str] | None = None, nofile: int | None = None) -> RunningDaemon:
        """Start gpuswapd (``env`` for this start only; ``nofile``: its soft descriptor limit)."""

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.prefix, *self.program, "--config", str(self.config), *self.args],
                                         env={**self.env, **(env or {})}, stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, preexec_fn=limit)
        if wait:
            deadline = time.monotonic() + 30
            while self.ctl("status", "--json").returncode != 0:
                if self.proc.poll() is not None:
                    raise StackError(f"gpuswapd exited with {self.proc.returncode}; log {self.log}:\n{self.tail()}")
                if time.monotonic() > deadline:
                    raise StackError(f"gpuswapd did not answer within 30s; log {self.log}:\n{self.tail()}")
                time.sleep(0.05)
        return self

    def tail(self, lines: int = 40) -> str:
        """Return the end of the daemon's log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def logged(self, event: str) -> list[dict[str, Any]]:
        """Every JSON log entry of this event, from the whole log (not only its tail)."""
        entries = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line that is not JSON (a traceback, say)
            if isinstance(entry, dict) and entry.get("event") == event:
                entries.append(entry)
        return entries

    def ctl(self, *args: str, timeout: float = 180, capture: bool = True,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run gpuswapctl with the daemon's socket (``capture=False``: straight to this terminal)."""
        return subprocess.run([str(BIN / "gpuswapctl"), *args], env=self.env, capture_output=capture,
                              text=True, timeout=timeout, check=check)

    def ctl_json(self, *args: str) -> dict[str, Any]:
        """Run gpuswapctl --json and parse its reply (it must succeed)."""
        out = self.ctl(*args, "--json")
        if out.returncode != 0:
            raise AssertionError(f"gpuswapctl {' '.join(args)} exited {out.returncode}: {out.stderr}")
        reply: dict[str, Any] = json.loads(out.stdout)
        return reply

    def status(self) -> dict[str, Any]:
        """Read gpuswapd's status."""
        return self.ctl_json("status")

    def wait_phase(self, phase: str, timeout: float = 120) -> dict[str, Any]:
        """Wait until the window is in ``phase`` (polling status)."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = self.status()
            if status["phase"] == phase:
                return status
            time.sleep(0.1)
        raise AssertionError(f"phase {phase} not reached in {timeout}s; last status {status}\n{self.tail()}")

    def signal(self, sig: int) -> None:
        """Send a signal to gpuswapd."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 120) -> int:
        """Stop gpuswapd with SIGTERM (as systemd does) and wait for it."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise StackError(f"gpuswapd did not stop within {timeout}s:\n{self.tail()}") from None

    def kill(self) -> None:
        """Kill gpuswapd with SIGKILL (a crash)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    @property
    def state_dir(self) -> Path:
        """Return the daemon's state directory."""
        return Path(tomllib.loads(self.config.read_text())["daemon"]["state_dir"])

    def state_phase(self) -> str | None:
        """Read the phase gpuswapd last persisted (its state document), without asking it."""
        try:
            window = json.loads((self.state_dir / "state.json").read_text())["window"]
        except (OSError, ValueError, KeyError):
            return None
        return None if window is None else str(window["phase"])
