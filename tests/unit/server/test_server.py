"""The socket server on a real Unix socket, over the window on fakes: floods and hang-ups."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from gpuswapd.server.listen import own_socket
from gpuswapd.server.peers import Peer
from gpuswapd.server.watch import MAX_BUFFERED
from tests.fakes import PROFILE_CONFIG, FakeWorld, running, settle
from tests.unit.conftest import ask, connect, run, serve

FLOOD = """
import signal, socket, sys
n = 0
signal.signal(signal.SIGTERM, lambda *_: (print(n), sys.exit(0)))
while True:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sys.argv[1])
    n += 1
"""


def test_a_stream_of_connections_does_not_starve_the_clients_already_served(tmp_path: Path) -> None:
    # Without caps in the way: sock_accept does not yield while connections are pending, so
    # only the accept loop's own yield lets the admitted clients (and the window) run.
    world = FakeWorld()
    server, path = serve(world, tmp_path, max_clients=65536)
    stop = threading.Event()
    connected = 0

    def flood() -> None:  # connect, hang up, again, as fast as another process allows
        nonlocal connected
        flooder = subprocess.Popen([sys.executable, "-c", FLOOD, str(path)], stdout=subprocess.PIPE, text=True)
        stop.wait()
        flooder.terminate()
        connected = int(flooder.communicate(timeout=10)[0] or 0)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            flooder = threading.Thread(target=flood)
            flooder.start()
            try:
                await asyncio.sleep(0.2)
                latencies = []
                for _ in range(5):
                    started = time.monotonic()
                    assert (await ask(path, {"op": "status"}))["ok"]
                    latencies.append(time.monotonic() - started)
                lease = await ask(path, {"op": "acquire", "for": 60, "holder": "under-flood"})
                assert lease["ok"], lease
                assert (await ask(path, {"op": "release", "lease": lease["lease"]["id"]}))["ok"]
                await settle(w)
            finally:
                stop.set()
                await asyncio.to_thread(flooder.join)
                await server.close()
            assert connected > 100 and max(latencies) < 2.0, (connected, latencies)

    run(main())


def test_a_client_that_hangs_up_after_its_lease_was_granted_holds_nothing(tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            keeper = await ask(path, {"op": "acquire", "for": 60, "holder": "keeper"})
            for n in range(50):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(path))
                    s.sendall(json.dumps({"op": "acquire", "for": 60, "holder": f"gone-{n}"}).encode() + b"\n")
            deadline = time.monotonic() + 5
            while [x.holder for x in w.leases()] != ["keeper"]:
                assert time.monotonic() < deadline, [x.holder for x in w.leases()]
                await asyncio.sleep(0.01)
            assert server.admission.open <= 1
            assert (await ask(path, {"op": "release", "lease": keeper["lease"]["id"]}))["ok"]
            await settle(w)
            await server.close()

    run(main())


def test_a_lease_bound_to_its_connection_ends_with_it_and_a_held_one_does_not(tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)

    async def held(message: dict[str, Any]) -> tuple[asyncio.StreamWriter, dict[str, Any]]:
        reader, writer = await asyncio.open_unix_connection(sock=await asyncio.to_thread(connect, path))
        writer.write(json.dumps(message).encode() + b"\n")
        while "event" in (reply := json.loads(await reader.readline())):
            pass
        return writer, reply

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            refused = await ask(path, {"op": "acquire", "for": 60, "holder": "x", "bind": "forever"})
            assert not refused["ok"] and "'bind' must be \"connection\"" in refused["error"]["message"]
            bound_conn, bound = await held({"op": "acquire", "for": 60, "holder": "gateway", "bind": "connection"})
            kept_conn, kept = await held({"op": "acquire", "for": 60, "holder": "run", "hold": True})
            assert bound["lease"]["bind"] == "connection" and kept["lease"]["bind"] is None
            status = await ask(path, {"op": "status"})
            assert status["resident_back"]["in_s"] >= 59.9  # the last lease's expiry, the linger, the close
            bound_conn.close()  # the gateway died: its lease ends at once
            kept_conn.close()
            deadline = time.monotonic() + 5
            while [x.holder for x in w.leases()] != ["run"]:
                assert time.monotonic() < deadline, [x.holder for x in w.leases()]
                await asyncio.sleep(0.01)
            assert (await ask(path, {"op": "release", "lease": kept["lease"]["id"]}))["ok"]
            await settle(w)
            assert (await ask(path, {"op": "status"}))["resident_back"] is None  # it serves now
            await server.close()

    run(main())


def test_a_queued_client_that_never_reads_is_dropped_and_its_request_withdrawn(tmp_path: Path) -> None:
    # A real socket (a socketpair, whose gpuswapd end buffers as little as the kernel allows):
    # the client asks for the bare profile behind an open window, reads nothing, and every change
    # of the queue sends it a line. gpuswapd keeps at most MAX_BUFFERED of them, then cuts it.
    world = FakeWorld(config=PROFILE_CONFIG)
    server, _ = serve(world, tmp_path)

    async def churn(w: Any, n: int) -> None:
        """Queue a request of another client and withdraw it: two lines for every queued client."""
        other = asyncio.create_task(w.acquire(f"churn-{n}", 60, profile="bare"))
        while not any(q["holder"] == f"churn-{n}" for q in w.queue_status()):
            await asyncio.sleep(0)
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other

    async def main() -> None:
        async with running(server.window) as w:
            keeper = await w.acquire("keeper", 600)
            ours, theirs = socket.socketpair()
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            assert server.serve_streams(Peer(os.getpid(), 0, 0), reader, writer) is None
            theirs.sendall(json.dumps({"op": "acquire", "for": 60, "profile": "bare", "holder": "silent"}).encode()
                           + b"\n")
            while not any(q["holder"] == "silent" for q in w.queue_status()):
                await asyncio.sleep(0.01)
            peak, churns = 0, 0
            with structlog.testing.capture_logs() as logs:
                while not writer.is_closing():
                    assert churns < 3000, f"never dropped; {peak} bytes buffered"  # about 630 churns do it
                    await churn(w, churns)
                    churns += 1
                    peak = max(peak, writer.transport.get_write_buffer_size())
                while any(q["holder"] == "silent" for q in w.queue_status()):  # withdrawn as by a hang-up
                    await asyncio.sleep(0.01)
            # It was cut at the cap: buffered up to about MAX_BUFFERED (sampled between lines), never
            # more than the line that crossed it.
            assert MAX_BUFFERED - 4096 < peak <= MAX_BUFFERED + 4096, peak
            assert [e["holder"] for e in logs if e["event"] == "client_dropped_unread"] == ["silent"]
            assert [q["holder"] for q in w.queue_status()] == []  # its request is gone with it
            theirs.setblocking(False)
            with contextlib.suppress(BlockingIOError, ConnectionError):
                while theirs.recv(65536):  # what the kernel still held for it, then the end
                    pass
            theirs.close()
            while server.admission.open:  # the connection is gone, and its task with it
                await asyncio.sleep(0.01)
            assert [x.holder for x in w.leases()] == ["keeper"]
            await w.release(keeper.id)
            await settle(w)
            await server.close()

    run(main())


def test_an_acquire_tells_its_token_first_and_the_token_reclaims_the_lease_on_a_new_connection(tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)

    async def acquire(message: dict[str, Any]) -> tuple[asyncio.StreamWriter, list[dict[str, Any]]]:
        reader, writer = await asyncio.open_unix_connection(sock=await asyncio.to_thread(connect, path))
        writer.write(json.dumps(message).encode() + b"\n")
        lines = [json.loads(await reader.readline())]
        while "event" in lines[-1]:
            lines.append(json.loads(await reader.readline()))
        return writer, lines

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            first, lines = await acquire({"op": "acquire", "for": 60, "holder": "run", "bind": "connection"})
            accepted, reply = lines[0], lines[-1]
            assert accepted["event"] == "accepted" and accepted["reclaim_s"] == 60
            assert reply["lease"]["token"] == accepted["token"]
            again, lines = await acquire({"op": "acquire", "for": 60, "holder": "run", "bind": "connection",
                                          "reclaim": accepted["token"]})
            assert lines[-1]["lease"]["id"] == reply["lease"]["id"]  # the same lease, not a second one
            first.close()  # the old connection is not the lease's any more
            await asyncio.sleep(0.1)
            assert [x.id for x in w.leases()] == [reply["lease"]["id"]]
            status = await ask(path, {"op": "status"})
            assert status["schedule"]["tenant"] == "default" and status["schedule"]["queue"] == {}
            assert set(status["price"]) == {"default"}
            again.close()  # its connection now: the lease ends with it
            await settle(w)
            await server.close()

    run(main())


def test_the_socket_group_is_resolved_once_at_start_and_off_the_event_loop(tmp_path: Path) -> None:
    # The group database may be LDAP or sssd, which can block: never on the loop, never per connection.
    world = FakeWorld()
    server, path = serve(world, tmp_path)
    asked: list[bool] = []
    real = server.host.group_id

    def group_id(name: str) -> int | None:
        asked.append(threading.current_thread() is threading.main_thread())
        return real(name)

    server.host.group_id = group_id  # type: ignore[method-assign]

    async def main() -> None:
        async with running(server.window):
            await server.start(own_socket(str(path), "", 0o600))
            for _ in range(3):
                assert (await ask(path, {"op": "status"}))["ok"]
                assert (await ask(path, {"op": "plan"}))["ok"] is not None
            await server.close()

    run(main())
    assert asked == [False]  # once, on a worker thread
