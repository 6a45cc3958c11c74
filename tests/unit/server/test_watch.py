"""Watchers and the /metrics endpoint on real sockets over the window on fakes: nobody waits for a client."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from gpuswapd.events import EventBus, to_event
from gpuswapd.observe import scrape
from gpuswapd.server.admission import Admission
from gpuswapd.server.listen import own_socket
from gpuswapd.server.watch import Watchers
from tests.fakes import FakeWorld, running
from tests.unit.conftest import connect, serve


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _watch(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(sock=await asyncio.to_thread(connect, path))
    writer.write(b'{"op": "watch"}\n')
    assert json.loads(await reader.readline()) == {"event": "subscribed"}
    return reader, writer


def test_a_watcher_that_reads_gets_every_event_and_one_that_does_not_is_dropped(tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)
    bus = EventBus()
    server.watchers = Watchers(bus, max_buffered=64 * 1024)

    async def main() -> None:
        async with running(server.window):
            await server.start(own_socket(str(path), ""))
            reader, writer = await _watch(path)
            # A watcher that never reads, with a small receive buffer.
            stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await asyncio.to_thread(stuck.connect, str(path))
            stuck.sendall(b'{"op": "watch"}\n')
            while bus.subscribers < 2:
                await asyncio.sleep(0.01)
            got = 0
            for batch in range(30):  # ~600 KB of events: far more than the stuck one may leave unread
                for n in range(batch * 100, batch * 100 + 100):
                    bus.publish(to_event("vram_free", "info", {"n": n, "pad": "x" * 150}, {}))
                while got < batch * 100 + 100:  # the reader keeps up, batch by batch
                    assert json.loads(await reader.readline())["n"] == got
                    got += 1
            assert server.watchers is not None and server.watchers.dropped == 1
            assert bus.subscribers == 1  # the stuck one is gone; the reader is still there
            writer.close()
            for _ in range(100):
                if bus.subscribers == 0:
                    break
                await asyncio.sleep(0.01)
            assert bus.subscribers == 0  # a watcher that hangs up is forgotten
            stuck.close()
            await server.close()

    run(main())


def test_watch_needs_no_more_than_status(tmp_path: Path) -> None:
    from gpuswapd.server.server import READ_ONLY

    assert "watch" in READ_ONLY


async def _http(port: int, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_metrics_are_served_and_nothing_else(tmp_path: Path) -> None:
    async def main() -> None:
        server = scrape.ScrapeServer("127.0.0.1:0", lambda: b"gpuswapd_leases 0\n", Admission(8, 8, 0, lambda p: False))
        await server.start()
        port = server.port
        assert await _http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"gpuswapd_leases 0\n")
        assert (await _http(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"))[0] == 200
        assert (await _http(port, b"GET / HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await _http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"))[0] == 405
        assert (await _http(port, b"nonsense\r\n\r\n"))[0] == 400
        await server.close()

    run(main())


def test_metrics_connections_share_the_caps_and_a_silent_one_is_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scrape, "FIRST_REQUEST_S", 0.3)

    async def main() -> None:
        admission = Admission(max_clients=10, per_uid=2, reserved=0, privileged=lambda p: False)
        server = scrape.ScrapeServer("127.0.0.1:0", lambda: b"x 1\n", admission)
        await server.start()
        silent = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert admission.open == 2
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        refusal = await reader.read()  # at once, before it says anything
        writer.close()
        assert refusal.startswith(b"HTTP/1.1 503 ") and b"max_clients_per_uid = 2" in refusal
        for reader, _ in silent:  # dropped after FIRST_REQUEST_S without a word
            assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.sleep(0.05)
        assert admission.open == 0
        assert (await _http(server.port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 200
        for _, writer in silent:
            writer.close()
        await server.close()

    run(main())


def test_closing_the_metrics_server_drops_a_connection_mid_request_and_counts_it_out() -> None:
    async def main() -> None:
        admission = Admission(max_clients=8, per_uid=8, reserved=0, privileged=lambda p: False)
        server = scrape.ScrapeServer("127.0.0.1:0", lambda: b"x 1\n", admission)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # the head is not finished: it waits for the rest
        await asyncio.sleep(0.05)
        assert admission.open == 1
        await asyncio.wait_for(server.close(), 5)  # long before FIRST_REQUEST_S would drop it
        assert admission.open == 0
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, without an answer
        writer.close()

    run(main())


def test_a_port_in_use_is_a_configuration_error() -> None:
    from gpuswapd.errors import ConfigError

    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = scrape.ScrapeServer(f"127.0.0.1:{taken.getsockname()[1]}", lambda: b"", Admission(8, 8, 0,
                                                                                                    lambda p: False))
            with pytest.raises(ConfigError, match=r"metrics\.listen: cannot listen on"):
                await server.start()

    run(main())
