"""A lean HTTP/1.1 client for the gateway's second hop: the model servers behind it.

httpx costs about 0.4 ms a request on this hop (its request model, httpcore's pool and h11's
state machine: 430-440 µs a round trip against 20 µs for the same exchange written by hand, on
this machine), which was most of what the gateway added to a small completion. This client writes
the request's head itself, parses the answer's, and hands the body on as it arrives, de-chunked
(as httpx's ``aiter_raw`` did). It speaks what the upstreams speak: HTTP/1.1 over TCP (``http``,
or ``https`` with the system's certificates); bodies framed by Content-Length, by chunks or by the
connection's end; 1xx answers skipped; keep-alive connections pooled (at most ``keep`` idle ones
in all, each kept ``expiry`` seconds). A connection taken from the pool that its server had closed
meanwhile (nothing came back on it) is replaced once by a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gpuswapd import clock

MAX_HEAD = 64 * 1024  # an answer's head, and a chunk's size line, at most this
PIECE = 64 * 1024  # the most a piece of body handed on holds


class HttpError(Exception):
    """The exchange failed; the message says how."""


class Unreached(HttpError):
    """Nothing accepted the connection (refused, no route): the request was not sent."""


class Timeout(HttpError):
    """No answer in time (the connection, the head, or between two pieces)."""


class Broken(HttpError):
    """The server broke off or spoke something that is not HTTP/1.1."""


@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    key: tuple[str, str, int]
    idle_since: float = 0.0

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


@dataclass(eq=False)
class Response:
    """An answer whose head has come; its body is read with ``pieces`` and given back with ``aclose``."""

    status: int
    headers: list[tuple[bytes, bytes]]  # names in lower case, in the order they came
    _conn: _Conn
    _client: Client
    _framing: str  # "length", "chunked", "close" or "none"
    _left: int = 0
    _keep: bool = True
    _done: bool = False
    _reading: bool = field(default=False, repr=False)

    def header(self, name: bytes) -> bytes | None:
        """Return the first value of a header (``name`` in lower case), or None."""
        return next((v for k, v in self.headers if k == name), None)

    async def pieces(self) -> AsyncIterator[bytes]:
        """Yield the body as it arrives (de-chunked); Broken if the server breaks off before its end."""
        if self._done or self._reading:
            return
        self._reading = True
        reader = self._conn.reader
        try:
            if self._framing == "length":
                while self._left > 0:
                    piece = await reader.read(min(self._left, PIECE))
                    if not piece:
                        raise Broken(f"the answer ended {self._left} bytes short of its Content-Length")
                    self._left -= len(piece)
                    yield piece
            elif self._framing == "chunked":
                while True:
                    line = await _line(reader, "a chunk's size")
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        raise Broken(f"a chunk's size is not hexadecimal: {line[:40]!r}") from None
                    if size < 0:
                        raise Broken("a chunk's size is negative")
                    if size == 0:
                        while await _line(reader, "a trailer"):  # trailers, up to the empty line
                            pass
                        break
                    while size > 0:
                        piece = await reader.read(min(size, PIECE))
                        if not piece:
                            raise Broken("the answer ended inside a chunk")
                        size -= len(piece)
                        yield piece
                    if await _line(reader, "a chunk's end"):
                        raise Broken("a chunk ran past its size")
            elif self._framing == "close":
                while piece := await reader.read(PIECE):
                    yield piece
            self._done = True
        except (ConnectionError, OSError) as err:
            raise Broken(f"the server broke off ({err.strerror or type(err).__name__})") from err
        finally:
            self._reading = False

    async def aclose(self) -> None:
        """Give the connection back to the pool if the body was read to its end, else close it."""
        if self._done and self._keep and self._conn.usable():
            self._client._put(self._conn)
        else:
            self._conn.close()
        self._done, self._keep = True, False


async def _line(reader: asyncio.StreamReader, what: str) -> bytes:
    """Read one CRLF-ended line, without its CRLF."""
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError:
        raise Broken(f"the answer ended in {what}") from None
    except asyncio.LimitOverrunError:
        raise Broken(f"{what} is longer than {MAX_HEAD} bytes") from None
    return line[:-2]


def _parse_head(head: bytes) -> tuple[bytes, int, list[tuple[bytes, bytes]]]:
    """Parse a status line and header fields (``head`` without its final CRLF CRLF)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise Broken(f"not an HTTP/1.1 status line: {lines[0][:60]!r}")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise Broken(f"a malformed header line: {line[:60]!r}")
        headers.append((name.lower(), value.strip(b" \t")))
    return parts[0], int(parts[1]), headers


class Client:
    """Requests to the upstreams over pooled HTTP/1.1 connections."""

    def __init__(self, keep: int, expiry: float, connect_s: float, read_s: float, write_s: float) -> None:
        self.keep, self.expiry = keep, expiry
        self.connect_s, self.read_s, self.write_s = connect_s, read_s, write_s
        self._idle: list[_Conn] = []  # oldest first
        self._tls: ssl.SSLContext | None = None

    async def request(self, method: str, url: str, headers: list[tuple[bytes, bytes]],
                      body: bytes | None) -> Response:
        """Send a request (``headers`` without Host or Content-Length); return once the answer's head has come."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise Unreached(f"not an http(s) URL: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise Unreached(f"a bad port in {url!r}") from None
        key = (parts.scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1")]
        head += [k + b": " + v + b"\r\n" for k, v in headers]
        if body is not None:
            head.append(b"content-length: %d\r\n" % len(body))
        data = b"".join(head) + b"\r\n" + (body or b"")
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._exchange(conn, method, data)
            except _Stale:
                pass  # its server closed it while it was idle: once more, on a new connection
        return await self._exchange(await self._connect(key), method, data, fresh=True)

    async def _exchange(self, conn: _Conn, method: str, data: bytes, fresh: bool = False) -> Response:
        got = b""
        try:
            conn.writer.write(data)
            async with asyncio.timeout(self.write_s):
                await conn.writer.drain()
            async with asyncio.timeout(self.read_s):
                while True:
                    got = await conn.reader.readuntil(b"\r\n\r\n")
                    version, status, headers = _parse_head(got[:-4])
                    if not 100 <= status < 200 or status == 101:
                        break  # an interim answer (100 Continue, 103 Early Hints) is skipped
        except BaseException as err:
            conn.close()
            if isinstance(err, asyncio.IncompleteReadError):
                if not fresh and not err.partial and not got:
                    raise _Stale from None
                raise Broken("the server closed the connection before its answer's head ended") from None
            if isinstance(err, TimeoutError):  # (an OSError too: looked at first)
                raise Timeout(f"no answer within {self.read_s:g}s") from None
            if isinstance(err, (ConnectionError, OSError)):
                if not fresh and not got:
                    raise _Stale from None
                raise Broken(f"the server broke off ({getattr(err, 'strerror', None) or type(err).__name__})") \
                    from err
            if isinstance(err, asyncio.LimitOverrunError):
                raise Broken(f"the answer's head is longer than {MAX_HEAD} bytes") from None
            raise
        return self._response(conn, method, version, status, headers)

    def _response(self, conn: _Conn, method: str, version: bytes, status: int,
                  headers: list[tuple[bytes, bytes]]) -> Response:
        tokens = {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",")}
        keep = version == b"HTTP/1.1" and b"close" not in tokens
        chunked = any(k == b"transfer-encoding" and b"chunked" in v.lower() for k, v in headers)
        lengths = {v for k, v in headers if k == b"content-length"}
        left = 0
        if method == "HEAD" or status in (204, 304):
            framing = "none"
        elif chunked:
            framing = "chunked"
        elif lengths:
            if len(lengths) > 1 or not next(iter(lengths)).isdigit():
                conn.close()
                raise Broken(f"a bad Content-Length: {sorted(lengths)!r}")
            framing, left = "length", int(next(iter(lengths)))
        else:
            framing, keep = "close", False
        return Response(status, headers, conn, self, framing, left, keep, framing == "none")

    async def _connect(self, key: tuple[str, str, int]) -> _Conn:
        scheme, host, port = key
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_s):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls, limit=MAX_HEAD)
        except TimeoutError:
            raise Timeout(f"no connection within {self.connect_s:g}s") from None
        except OSError as err:
            raise Unreached(err.strerror or str(err) or type(err).__name__) from err
        return _Conn(reader, writer, key)

    def _take(self, key: tuple[str, str, int]) -> _Conn | None:
        now = clock.monotonic()
        found = None
        for conn in list(self._idle):
            if now - conn.idle_since > self.expiry or not conn.usable():
                self._idle.remove(conn)
                conn.close()
            elif found is None and conn.key == key:
                found = conn
        if found is not None:
            self._idle.remove(found)
        return found

    def _put(self, conn: _Conn) -> None:
        conn.idle_since = clock.monotonic()
        self._idle.append(conn)
        while len(self._idle) > self.keep:
            self._idle.pop(0).close()

    async def aclose(self) -> None:
        """Close every idle connection."""
        for conn in self._idle:
            with contextlib.suppress(Exception):
                conn.close()
        self._idle.clear()


class _Stale(Exception):
    """A pooled connection its server had closed: nothing was sent back on it."""
