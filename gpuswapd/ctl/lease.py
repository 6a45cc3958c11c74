"""Hold a lease from the command line while something runs: acquire, renew, release."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpuswapd.ctl.client import Client
from gpuswapd.ctl.render import Progress


@contextmanager
def held_lease(socket: str, acquire: dict[str, Any], quiet: bool = False,
               on_event: Callable[[dict[str, Any]], None] | None = None) -> Iterator[dict[str, Any]]:
    """Acquire a lease, renew it in the background at half its duration, release it at the end.

    The acquire's connection stays open for the whole lease: gpuswapd sends the lease's events on
    it (a preemption's ``preempting`` notice, then ``preempted``), which go to ``on_event``. The
    lease is bound to that connection (``"bind": "connection"``): if this process dies, even by
    SIGKILL, its connection ends and so does the lease, instead of lasting until it expires.
    """
    progress = Progress(enabled=not quiet)
    holding = Client(socket)
    try:
        # No read timeout: the window may take minutes to open; gpuswapd bounds it.
        reply = holding.request({**acquire, "bind": "connection"}, on_event=progress.event, timeout=None)
    except BaseException:
        holding.close()
        raise
    finally:
        progress.close()

    revoked = threading.Event()

    def told(event: dict[str, Any]) -> None:
        if event.get("event") == "preempted":
            revoked.set()
        if event.get("event") == "preempting":
            print(f"gpuswapctl: preempted: {event.get('by')} (profile {event.get('profile')}, priority "
                  f"{event.get('priority')}) needs the GPU; this lease is revoked in {event.get('grace_s'):g}s",
                  file=sys.stderr)
        if on_event is not None:
            on_event(event)

    listener = threading.Thread(target=holding.listen, args=(told,), name="lease-events", daemon=True)
    listener.start()
    lease: dict[str, Any] = {**reply["lease"], "kind": reply.get("kind", "engine"),
                             "gpu_index": reply.get("gpu_index", 0), "profile": reply.get("profile", "default")}
    duration = max(1.0, lease["expires_at"] - lease["granted_at"])
    stop = threading.Event()

    def renew() -> None:
        told = False
        while not stop.wait(duration / 2):
            try:
                with Client(socket) as client:
                    renewed = client.request({"op": "renew", "lease": lease["id"], "for": duration})
            except Exception as err:  # the work goes on; the window may have closed under it
                print(f"gpuswapctl: could not renew lease {lease['id']}: {err}", file=sys.stderr)
                continue
            if renewed.get("capped_by") == "fair_after" and not told:
                told = True  # once: every renewal from now on is capped the same way
                waiting = renewed.get("waiting") or {}
                print(f"gpuswapctl: lease {lease['id']} is no longer extended: {waiting.get('holder')} waits for "
                      f"profile {waiting.get('profile')} (daemon.fair_after); it ends at its expiry",
                      file=sys.stderr)

    renewer = threading.Thread(target=renew, name="lease-renewer", daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        try:
            if not revoked.is_set():  # a preemption revoked it already
                # Released on a connection of its own (which says whether it worked) before the
                # bound connection closes; closing it alone would end the lease too.
                try:
                    with Client(socket) as client:
                        client.request({"op": "release", "lease": lease["id"]})
                except Exception as err:  # the window may already be gone; the work's result still stands
                    print(f"gpuswapctl: could not release lease {lease['id']}: {err}", file=sys.stderr)
        finally:
            holding.close()
