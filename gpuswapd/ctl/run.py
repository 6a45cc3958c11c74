"""``gpuswapctl run``: hold a lease while a command runs, and exit with the command's status."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType
from typing import Any

from gpuswapd.ctl.client import Client
from gpuswapd.ctl.render import Progress
from gpuswapd.errors import GpuswapError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_under_lease(socket: str, command: list[str], acquire: dict[str, Any], quiet: bool = False) -> int:
    """Acquire, run ``command``, renew while it runs, release when it ends; return its exit status."""
    progress = Progress(enabled=not quiet)
    try:
        with Client(socket) as client:
            lease = client.request(acquire, on_event=progress.event)["lease"]
    finally:
        progress.close()
    duration = max(1.0, lease["expires_at"] - lease["granted_at"])
    try:
        proc = subprocess.Popen(command)
    except OSError as err:
        _release(socket, lease["id"])
        print(f"gpuswapctl: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
        return 127 if isinstance(err, FileNotFoundError) else 126

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        status = _wait_renewing(socket, proc, lease["id"], duration)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _release(socket, lease["id"])
    return 128 - status if status < 0 else status


def _wait_renewing(socket: str, proc: subprocess.Popen[bytes], lease_id: str, duration: float) -> int:
    """Wait for the command, renewing the lease at half its duration."""
    while True:
        try:
            return proc.wait(timeout=duration / 2)
        except subprocess.TimeoutExpired:
            pass
        try:
            with Client(socket) as client:
                client.request({"op": "renew", "lease": lease_id, "for": duration})
        except (GpuswapError, OSError, Exception) as err:  # keep waiting for the command regardless
            print(f"gpuswapctl: could not renew lease {lease_id}: {err}", file=sys.stderr)


def _release(socket: str, lease_id: str) -> None:
    try:
        with Client(socket) as client:
            client.request({"op": "release", "lease": lease_id})
    except Exception as err:  # the window may already be gone; the command's status is what matters
        print(f"gpuswapctl: could not release lease {lease_id}: {err}", file=sys.stderr)
