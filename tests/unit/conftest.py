"""The fast layer: no root, no test world; gpuswapd's own log is kept to warnings and errors.

What its tests share lives here (a minimal configuration, the socket server on a real Unix socket,
the profiles' world of fakes): a test module imports it from here, never from another test module
(``tests/unit/test_layout.py`` fails on that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuswapd.adapters.gpu import make_probe
from gpuswapd.checks import machine
from gpuswapd.config import parse_config
from gpuswapd.logs import setup_logging
from gpuswapd.outside import Deadlines, Outside
from gpuswapd.server.server import Server
from gpuswapd.window.plan import Plan
from tests.fakes import BASELINE, CONFIG, PROFILE_CONFIG, PROFILES, FakeWorld

# Thousands of windows run here on fakes: their info lines cost more than the checks themselves.
setup_logging("warning", json=False, cache=False)


# The known-bad table of this checkout, and no operator's rows: never the installed machine's
# /usr/share/gpuswapd/known-bad.toml or /etc/gpuswapd/known-bad.d (a package's check() runs here too).
os.environ.setdefault("GPUSWAPD_KNOWN_BAD",
                      str(Path(__file__).resolve().parents[2] / "gpuswapd" / "data" / "known-bad.toml"))
os.environ.setdefault("GPUSWAPD_KNOWN_BAD_DIR", str(Path(__file__).resolve().parent / "no-known-bad.d"))  # absent

# The smallest valid configuration: one resident unit, one engine.
MINIMAL = """
[resident]
units = ["strata.service"]
[resident.verify]
url = "http://127.0.0.1:8080/v1/chat/completions"
model = "strata"
[window]
health_url = "http://127.0.0.1:18020/health"
[window.container]
name = "hyperqwen"
image = "hyperqwen:latest"
[window.verify]
url = "http://127.0.0.1:18020/v1/chat/completions"
model = "hyperqwen"
"""


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """gpuswapd.daemon (it needs pydbus: the package's check() runs this layer without it)."""
    module = pytest.importorskip("gpuswapd.daemon", exc_type=ImportError)
    # main() would set up logging for a daemon: onto this test's captured stderr, for good.
    monkeypatch.setattr(module, "setup_logging", lambda *args, **kwargs: None)
    # --check-config reads the card: never this machine's through NVML (a test that wants a card
    # gives gpu.probe = "nvidia-smi" a script of its own).
    monkeypatch.setattr(machine, "make_probe", lambda gpu: None if gpu.probe == "nvml" else make_probe(gpu))
    return module


def card_of(tmp_path: Path, mib: int = 24576) -> str:
    """Write an nvidia-smi that reads a card of ``mib`` MiB; return ``[gpu]`` keys that use it."""
    smi = tmp_path / "nvidia-smi"  # as `--query-gpu=memory.used,memory.total,memory.free` answers
    smi.write_text(f"#!/bin/sh\necho '1000, {mib}, {mib - 1000}'\n")
    smi.chmod(0o755)
    return f'probe = "nvidia-smi"\nnvidia_smi = "{smi}"\n'


def run(coro: Any) -> Any:
    """Run ``coro`` on a fresh event loop, failing after 30 s."""
    return asyncio.run(asyncio.wait_for(coro, 30))


async def until(check: Callable[[], Any], timeout: float = 5.0) -> None:
    """Poll ``check`` on the loop until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.002)


# -- the profiles' world -----------------------------------------------------------------------


def world(**daemon: str) -> FakeWorld:
    """Return a FakeWorld with the fakes' engine profiles and the bare one, and these ``[daemon]`` keys."""
    keys = "".join(f'{k} = "{v}"\n' if isinstance(v, str) else f"{k} = {v}\n" for k, v in daemon.items())
    text = CONFIG.replace("[daemon]\n", f"[daemon]\n{keys}", 1) + PROFILES
    return FakeWorld(config=parse_config(text, "<profiles>") if daemon else PROFILE_CONFIG)


def resident_back(w: FakeWorld) -> bool:
    """Tell whether the resident's units and timers are as they were before any window."""
    snap = w.snapshot()
    return snap["units"] == BASELINE["units"] and snap["timers"] == BASELINE["timers"]


# -- the socket server on a real Unix socket -----------------------------------------------------

# Deadlines of the order of the daemon's defaults: under a flood, on a loaded machine (inside
# makepkg's check() beside the test world, say), the fakes' 0.15 s would fail the window itself.
FLOOD_DEADLINES = Deadlines(systemd=5, docker=5, gpu=5, state=5, http=5, workers=4)


def serve(world: FakeWorld, tmp_path: Path, max_clients: int = 512) -> tuple[Server, Path]:
    """Return a Server over ``world``'s window and the socket path it is to listen on."""
    path = tmp_path / "gpuswapd.sock"
    # Whoever runs the tests (root, or makepkg's build user) is in the socket's group.
    config = dataclasses.replace(world.config, daemon=dataclasses.replace(
        world.config.daemon, max_clients=max_clients, max_clients_per_uid=max_clients,
        socket_group=grp.getgrgid(os.getgid()).gr_name))
    window = world.window(Outside(FLOOD_DEADLINES))
    server = Server(config, window, world.store, world.systemd, window.outside,  # type: ignore[arg-type]
                    planner=lambda profile: asyncio.sleep(0, Plan.from_dict({})))
    return server, path


def connect(path: Path) -> socket.socket:
    """Connect to the socket at ``path``, waiting while its backlog is full; return it non-blocking."""
    # A blocking connect waits while the listen backlog is full (a non-blocking one fails).
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking, no timeout: see above
    sock.connect(str(path))
    sock.setblocking(False)
    return sock


async def ask(path: Path, message: dict[str, Any]) -> dict[str, Any]:
    """Send ``message`` on a new connection and return the final reply (progress events skipped)."""
    reader, writer = await asyncio.open_unix_connection(sock=await asyncio.to_thread(connect, path))
    writer.write(json.dumps(message).encode() + b"\n")
    try:
        while True:
            reply: dict[str, Any] = json.loads(await reader.readline())
            if "event" not in reply:
                return reply
    finally:
        writer.close()
