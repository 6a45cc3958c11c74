"""``gpuswapctl run``: hold a lease while a command runs, and exit with the command's status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

from gpuswapd.ctl.lease import held_lease

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Preemption:
    """A preemption's notice, which may come before the command has even started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.notice: dict[str, Any] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def told(self, event: dict[str, Any]) -> None:
        if event.get("event") != "preempting":
            return
        with self.lock:
            self.notice = event
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)  # its grace starts now: time to checkpoint

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        with self.lock:
            self.proc = proc
            if self.notice is not None:
                proc.send_signal(signal.SIGTERM)


def run_under_lease(socket: str, command: list[str], acquire: dict[str, Any], quiet: bool = False) -> int:
    """Acquire, run ``command`` while the lease is renewed, release when it ends; return its status.

    A preemption's notice sends the command SIGTERM; if it ends on it, run exits 143 and says why.
    """
    preemption = _Preemption()
    with held_lease(socket, acquire, quiet, on_event=preemption.told) as lease:
        env = None
        if lease.get("kind") == "bare":  # the card is cleared for this command: point CUDA at it
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(lease.get("gpu_index", 0))}
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as err:
            print(f"gpuswapctl: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
            return 127 if isinstance(err, FileNotFoundError) else 126
        preemption.started(proc)

        def forward(signum: int, _frame: FrameType | None) -> None:
            proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            status = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    notice = preemption.notice
    if notice is not None:
        ended = "ended on its SIGTERM" if status == -signal.SIGTERM else f"exited with status {status}"
        print(f"gpuswapctl: {command[0]} {ended}: the window was preempted by {notice.get('by')} (profile "
              f"{notice.get('profile')}, priority {notice.get('priority')}) after a notice of "
              f"{notice.get('grace_s'):g}s", file=sys.stderr)
    # A command killed by a signal exits like a shell reports it: 128 + the signal number.
    return 128 - status if status < 0 else status
