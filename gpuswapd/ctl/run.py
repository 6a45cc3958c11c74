"""``gpuswapctl run``: hold a lease while a command runs, and exit with the command's status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Any

from gpuswapd.ctl.lease import held_lease

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_under_lease(socket: str, command: list[str], acquire: dict[str, Any], quiet: bool = False) -> int:
    """Acquire, run ``command`` while the lease is renewed, release when it ends; return its status."""
    with held_lease(socket, acquire, quiet) as lease:
        env = None
        if lease.get("kind") == "bare":  # the card is cleared for this command: point CUDA at it
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(lease.get("gpu_index", 0))}
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as err:
            print(f"gpuswapctl: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
            return 127 if isinstance(err, FileNotFoundError) else 126

        def forward(signum: int, _frame: FrameType | None) -> None:
            proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            status = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    # A command killed by a signal exits like a shell reports it: 128 + the signal number.
    return 128 - status if status < 0 else status
