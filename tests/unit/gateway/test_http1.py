"""The gateway's lean HTTP/1.1 client against real loopback servers that answer as scripted."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpuswapd.errors import GpuswapError
from gpuswapd.gateway import http1
from gpuswapd.gateway.errors import UpstreamFailed, UpstreamUnreached
from gpuswapd.gateway.upstream import Upstream

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def client() -> http1.Client:
    return http1.Client(keep=8, expiry=30.0, connect_s=2.0, read_s=2.0, write_s=2.0)


async def serve(script: Script) -> tuple[asyncio.Server, str, list[int]]:
    """A server that runs ``script(reader, writer, nth request on this connection)`` per request."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                               if x.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                n += 1
                await script(reader, writer, n)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections


def answers_and_closes(answer: bytes) -> Script:
    """A script that sends ``answer`` as it is and closes the connection."""
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(answer)
        await w.drain()
        w.close()
    return script


async def body(response: http1.Response) -> bytes:
    data = b"".join([p async for p in response.pieces()])
    await response.aclose()
    return data


def test_a_sized_answer_is_read_whole_and_its_connection_reused() -> None:
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"n\": %d}   " % n)

    async def main() -> None:
        server, url, connections = await serve(script)
        c = client()
        for n in (1, 2, 3):
            r = await c.request("POST", f"{url}/v1/chat/completions?x=1", [(b"content-type", b"application/json")],
                                b'{"model": "m"}')
            assert r.status == 200 and r.header(b"content-type") == b"application/json"
            assert await body(r) == b'{"n": %d}   ' % n
        assert len(connections) == 1  # kept alive between them
        await c.aclose()
        server.close()

    run(main())


def test_a_chunked_stream_is_handed_on_piece_by_piece_as_it_comes() -> None:
    go = asyncio.Event()

    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"10;ext=1\r\ndata: {\"a\": 1}\n\n\r\n")
        await w.drain()
        await go.wait()
        w.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\nx-trailer: 1\r\n\r\n")

    async def main() -> None:
        server, url, connections = await serve(script)
        c = client()
        r = await c.request("POST", url + "/v1/chat/completions", [], b"{}")
        pieces = r.pieces()
        assert await anext(pieces) == b'data: {"a": 1}\n\n'  # before the rest was even sent
        go.set()
        assert b"".join([p async for p in pieces]) == b"data: [DONE]\n\n"
        await r.aclose()
        r = await c.request("GET", url + "/health", [], None)  # the same connection again
        go.set()
        assert (await body(r)).endswith(b"[DONE]\n\n") and len(connections) == 1
        await c.aclose()
        server.close()

    run(main())


def test_interim_answers_are_skipped_and_bodiless_and_close_framed_answers_are_read_right() -> None:
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        else:
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await w.drain()
            w.close()

    async def main() -> None:
        server, url, connections = await serve(script)
        c = client()
        r = await c.request("DELETE", url + "/x", [], None)
        assert r.status == 204 and await body(r) == b""
        r = await c.request("GET", url + "/y", [], None)
        assert r.status == 200 and await body(r) == b"until the end"
        r = await c.request("GET", url + "/z", [], None)  # the closed one is not reused
        assert await body(r) == b"" and len(connections) == 2
        await c.aclose()
        server.close()

    run(main())


def test_a_kept_connection_its_server_closed_is_replaced_once_without_the_caller_seeing_it() -> None:
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()  # a keep-alive timeout, without saying Connection: close

    async def main() -> None:
        server, url, connections = await serve(script)
        c = client()
        for _ in range(3):
            r = await c.request("POST", url, [], b"{}")
            assert await body(r) == b"ok"
        assert len(connections) == 3
        await c.aclose()
        server.close()

    run(main())


@pytest.mark.parametrize(("answer", "says"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "5 bytes short"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not hexadecimal"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "inside a chunk"),
])
def test_a_body_broken_off_is_an_error_and_its_connection_is_not_kept(answer: bytes, says: str) -> None:
    async def main() -> None:
        server, url, _ = await serve(answers_and_closes(answer))
        c = client()
        r = await c.request("GET", url, [], None)
        with pytest.raises(http1.Broken, match=says):
            await body(r)
        await r.aclose()
        assert c._idle == []
        server.close()

    run(main())


@pytest.mark.parametrize(("answer", "says"), [
    (b"SMTP ready\r\n\r\n", "not an HTTP/1.1 status line"),
    (b"HTTP/1.1 200 OK\r\n bad: fold\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nx: " + b"y" * 70000 + b"\r\n\r\n", "longer than"),
    (b"HTTP/1.1 200 OK\r\nContent-Le", "closed the connection before its answer's head ended"),
])
def test_an_answer_that_is_not_http_is_an_error(answer: bytes, says: str) -> None:
    async def main() -> None:
        server, url, _ = await serve(answers_and_closes(answer))
        c = client()
        with pytest.raises(http1.Broken, match=says):
            await c.request("GET", url, [], None)
        server.close()

    run(main())


def test_nothing_listening_is_unreached_and_a_silent_server_times_out() -> None:
    async def script(_r: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        c = client()
        with pytest.raises(http1.Unreached):
            await c.request("GET", f"http://127.0.0.1:{port}/v1/models", [], None)
        up = Upstream()
        with pytest.raises(UpstreamUnreached, match="nothing answers"):
            await up.open("GET", f"http://127.0.0.1:{port}/v1/models", [], b"")
        server, url, _ = await serve(script)
        c.read_s = 0.2
        with pytest.raises(http1.Timeout):
            await c.request("GET", url, [], None)
        with pytest.raises(UpstreamFailed, match="no answer in time"):
            await up.get_json(url + "/v1/models", timeout=0.2)
        await up.aclose()
        server.close()

    run(main())


def test_the_upstream_passes_the_answer_on_without_hop_by_hop_headers() -> None:
    async def script(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                b"Keep-Alive: timeout=5\r\nX-Request-Id: 7\r\nContent-Length: 16\r\n\r\n{\"data\": [1, 2]}")

    async def main() -> None:
        server, url, _ = await serve(script)
        up = Upstream()
        answer = await up.open("POST", url + "/v1/x", [(b"host", b"gw"), (b"x-api-key", b"k")], b"{}")
        assert answer.status == 200
        assert answer.headers == [(b"content-type", b"application/json"), (b"x-request-id", b"7"),
                                  (b"content-length", b"16")]
        assert b"".join([p async for p in answer.pieces(1.0)]) == b'{"data": [1, 2]}'
        await answer.close()
        assert await up.get_json(url + "/v1/models", timeout=1.0) == {"data": [1, 2]}
        await up.aclose()
        server.close()

    run(main())
    assert issubclass(UpstreamFailed, Exception) and not issubclass(http1.HttpError, GpuswapError)
