"""Hold a lease from the command line while something runs: acquire, renew, release."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuswapd.ctl.client import Client
from gpuswapd.ctl.render import Progress


@contextmanager
def held_lease(socket: str, acquire: dict[str, Any], quiet: bool = False) -> Iterator[dict[str, Any]]:
    """Acquire a lease, renew it in the background at half its duration, release it at the end."""
    progress = Progress(enabled=not quiet)
    try:
        with Client(socket) as client:
            # No read timeout: the window may take minutes to open; gpuswapd bounds it.
            reply = client.request(acquire, on_event=progress.event, timeout=None)
    finally:
        progress.close()
    lease: dict[str, Any] = {**reply["lease"], "kind": reply.get("kind", "engine"),
                             "gpu_index": reply.get("gpu_index", 0), "profile": reply.get("profile", "default")}
    duration = max(1.0, lease["expires_at"] - lease["granted_at"])
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(duration / 2):
            try:
                with Client(socket) as client:
                    client.request({"op": "renew", "lease": lease["id"], "for": duration})
            except Exception as err:  # the work goes on; the window may have closed under it
                print(f"gpuswapctl: could not renew lease {lease['id']}: {err}", file=sys.stderr)

    renewer = threading.Thread(target=renew, name="lease-renewer", daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        try:
            with Client(socket) as client:
                client.request({"op": "release", "lease": lease["id"]})
        except Exception as err:  # the window may already be gone; the work's result still stands
            print(f"gpuswapctl: could not release lease {lease['id']}: {err}", file=sys.stderr)
