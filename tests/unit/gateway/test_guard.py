"""The gateway's connection guard (guard.py) on a real uvicorn and real sockets, in-process.

Slow heads and huge heads are cut, counted, and never keep a fresh client out; requests with
bodies and kept-alive connections go on as before.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import uvicorn
import uvloop

from gpuswapd.gateway import guard

HEAD = b"GET / HTTP/1.1\r\nhost: x\r\n"


async def app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Served:
    def __init__(self) -> None:
        self.cuts: list[str] = []
        self.port = 0


async def _serve() -> AsyncIterator[Served]:
    served = Served()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    served.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                           http=guard.protocol(served.cuts.append)))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield served
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 5)


# The gateway runs on uvloop (uvicorn's loop="auto"); asyncio's own loop hands connections over alike.
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


async def _ask(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return answer


@LOOPS
def test_slow_huge_and_crowding_heads_are_cut_and_a_fresh_client_still_gets_in(monkeypatch: pytest.MonkeyPatch,
                                                                                run: Any) -> None:
    monkeypatch.setattr(guard, "HEAD_S", 0.3)
    monkeypatch.setattr(guard, "MAX_PENDING", 3)
    monkeypatch.setattr(guard, "MAX_HEAD", 4096)

    async def main() -> None:
        async for served in _serve():
            # A head that does not finish in time: 408, closed.
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")
            answer = await asyncio.wait_for(reader.read(), 3)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            writer.close()
            # A head over the limit: 431 (sent in pieces, as a client does).
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            writer.write(HEAD)
            for _ in range(4):
                writer.write(b"x-pad: " + b"a" * 2000 + b"\r\n")
                await asyncio.sleep(0.01)
            answer = await asyncio.wait_for(reader.read(), 3)
            assert answer.startswith(b"HTTP/1.1 431 "), answer
            writer.close()
            # Three heads that never finish, and a fourth: the oldest goes, the fresh client gets in.
            crowd = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(3)]
            for _, w in crowd:
                w.write(b"GET / HT")
            await asyncio.sleep(0.05)
            assert (await _ask(served.port, HEAD + b"\r\n")).startswith(b"HTTP/1.1 200 ")
            assert await asyncio.wait_for(crowd[0][0].read(), 1) == b""  # closed
            # A body larger than the head limit in the same packets as the head, and keep-alive.
            body = b"b" * 100_000
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            post = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + body
            writer.write(post + post)
            first = await asyncio.wait_for(reader.readuntil(b"100000"), 3)
            second = await asyncio.wait_for(reader.readuntil(b"100000"), 3)
            assert first.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 200 " in second
            writer.close()
            await asyncio.sleep(0.4)  # the two heads left are cut for being slow
            for _, w in crowd:
                w.close()
            assert sorted(served.cuts) == ["crowded", "large", "slow", "slow", "slow"], served.cuts
    run(asyncio.wait_for(main(), 20))


@LOOPS
def test_past_the_connections_served_a_new_one_gets_503_with_retry_after(monkeypatch: pytest.MonkeyPatch,
                                                                        run: Any) -> None:
    monkeypatch.setattr(guard, "MAX_CONNECTIONS", 1)

    async def main() -> None:
        async for served in _serve():
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            writer.write(HEAD + b"\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n0"), 3)).startswith(b"HTTP/1.1 200 ")  # kept
            answer = await _ask(served.port, HEAD + b"\r\n")
            assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5" in answer
            writer.close()
            await asyncio.sleep(0.1)
            assert (await _ask(served.port, HEAD + b"\r\n")).startswith(b"HTTP/1.1 200 ")  # its place given back
            assert served.cuts == ["full"]
    run(asyncio.wait_for(main(), 20))


@LOOPS
def test_a_head_in_pieces_bare_newlines_and_bytes_that_are_not_http(run: Any) -> None:
    async def main() -> None:
        async for served in _serve():
            # The blank line split across reads, one byte at a time at the end.
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r")
            await writer.drain()
            await asyncio.sleep(0.05)
            for piece in (b"\n", b"\r", b"\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.02)
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n0"), 3)).startswith(b"HTTP/1.1 200 ")
            # A second request on the same connection, in one piece.
            writer.write(HEAD + b"\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n0"), 3)).startswith(b"HTTP/1.1 200 ")
            writer.close()
            # A head ended by bare newlines reaches httptools, which says what it makes of it.
            answer = await _ask(served.port, b"GET / HTTP/1.1\nhost: x\n\n")
            assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 400 ")), answer
            # Bytes that cannot begin a request line (a TLS hello, a lower-case method): 400 at once.
            for junk in (b"\x16\x03\x01\x02\x00\x01", b"get / HTTP/1.1\r\n", b"A" * 30):
                answer = await _ask(served.port, junk)
                assert answer.startswith(b"HTTP/1.1 400 "), (junk, answer)
            assert served.cuts == []
    run(asyncio.wait_for(main(), 20))


@LOOPS
def test_a_graceful_shutdown_closes_heads_still_coming(run: Any) -> None:
    async def main() -> None:
        got = None
        async for served in _serve():
            reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
            writer.write(b"GET / HT")
            await writer.drain()
            await asyncio.sleep(0.05)
            got = reader
        assert got is not None
        assert await asyncio.wait_for(got.read(), 2) == b""  # closed by the shutdown, not left for its timer
    run(asyncio.wait_for(main(), 20))
