"""Hold a lease from the command line while something runs: acquire, renew, release, reclaim after a restart."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpuswapd.ctl.client import Client, Unreachable
from gpuswapd.ctl.reclaim import Acquirer
from gpuswapd.ctl.render import Progress
from gpuswapd.errors import GpuswapError

RENEW_RETRY_S = (1.0, 10.0)  # a renewal that failed is tried again after this, doubling up to the cap


@contextmanager
def held_lease(socket: str, acquire: dict[str, Any], quiet: bool = False,
               on_event: Callable[[dict[str, Any]], None] | None = None) -> Iterator[dict[str, Any]]:
    """Acquire a lease, renew it in the background at half its duration, release it at the end.

    The acquire's connection stays open for the whole lease: gpuswapd sends the lease's events on
    it (a preemption's ``preempting`` notice, then ``preempted``), which go to ``on_event``. The
    lease is bound to that connection (``"bind": "connection"``): if this process dies, even by
    SIGKILL, its connection ends and so does the lease, instead of lasting until it expires. If
    gpuswapd restarts, the connection ends the other way: the lease is reclaimed with its token on
    a new connection (gpuswapd keeps it ``daemon.reclaim_grace`` for that), and what runs under
    it is never told.
    """
    progress = Progress(enabled=not quiet)
    acquirer = Acquirer(socket, {**acquire, "bind": "connection"}, on_event=progress.event, quiet=quiet)
    try:
        holding, reply = acquirer.acquire()
    finally:
        progress.close()
    acquirer.on_event = None  # a reclaim's events are the lease's, passed on by listen()

    revoked = threading.Event()
    stop = threading.Event()
    conn = {"client": holding}
    lock = threading.Lock()

    def told(event: dict[str, Any]) -> None:
        if event.get("event") == "preempted":
            revoked.set()
        if event.get("event") == "preempting":
            print(f"gpuswapctl: preempted: {event.get('by')} (profile {event.get('profile')}, priority "
                  f"{event.get('priority')}) needs the GPU; this lease is revoked in {event.get('grace_s'):g}s",
                  file=sys.stderr)
        if on_event is not None:
            on_event(event)

    lease: dict[str, Any] = {**reply["lease"], "kind": reply.get("kind", "engine"),
                             "gpu_index": reply.get("gpu_index", 0), "profile": reply.get("profile", "default")}

    def listen() -> None:
        """Pass the lease's events on; when gpuswapd goes away, reclaim the lease on a new connection."""
        while True:
            conn["client"].listen(told)
            if stop.is_set() or revoked.is_set():
                return
            try:
                again, answer = acquirer.acquire()  # the connection ended: gpuswapd restarted, or died
            except (Unreachable, GpuswapError) as err:
                print(f"gpuswapctl: lease {lease['id']} could not be reclaimed after gpuswapd went away: "
                      f"{getattr(err, 'message', None) or err}; the command goes on", file=sys.stderr)
                return
            with lock:
                if stop.is_set():
                    again.close()
                    return
                conn["client"] = again
                lease["id"] = answer["lease"]["id"]  # the same lease, or a new one if it had ended

    listener = threading.Thread(target=listen, name="lease-events", daemon=True)
    listener.start()
    duration = max(1.0, lease["expires_at"] - lease["granted_at"])

    def renew() -> None:
        told = False
        failures = 0
        wait = duration / 2
        while not stop.wait(wait):
            try:
                with Client(socket) as client:
                    renewed = client.request({"op": "renew", "lease": lease["id"], "for": duration})
            except Exception as err:  # the work goes on; gpuswapd may be restarting, or the window gone
                if failures == 0:
                    print(f"gpuswapctl: could not renew lease {lease['id']}: {err}; retrying", file=sys.stderr)
                failures += 1
                wait = min(duration / 2, RENEW_RETRY_S[0] * 2 ** min(failures - 1, 8), RENEW_RETRY_S[1])
                continue
            failures, wait = 0, duration / 2
            if renewed.get("capped_by") == "fair_after" and not told:
                told = True  # once: every renewal from now on is capped the same way
                waiting = renewed.get("waiting") or {}
                print(f"gpuswapctl: lease {lease['id']} is no longer extended: {waiting.get('holder')} waits for "
                      f"profile {waiting.get('profile')} (its share of the card); it ends at its expiry",
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
            with lock:
                conn["client"].close()
