"""The model servers behind the gateway: one request each, the answer passed through as it arrives.

Nothing is buffered: each piece of the upstream's body is handed on as it is read, raw (the same
bytes, so the same SSE framing and the same final ``usage`` chunk). The hop is gpuswapd's own lean
HTTP/1.1 client (http1.py), or httpx where a test hands in an httpx transport (its MockTransport
stands in for the model servers). Either one's errors leave this module as ``UpstreamFailed``
(``UpstreamUnreached`` when nothing accepted the connection), the most specific message first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx

from gpuswapd.gateway import http1
from gpuswapd.gateway.errors import UpstreamFailed, UpstreamUnreached

CONNECT_S = 5.0
READ_S = 600.0  # between two pieces of an answer (a long prefill comes before the first)
KEEP_IDLE = 8  # idle upstream connections kept between requests (see Upstream)
WRITE_S = 60.0
# Not passed on either way (RFC 9110 section 7.6.1), and what the two hops set for themselves.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})


@dataclass
class Answer:
    """An upstream's answer whose body is still to be read."""

    status: int
    headers: list[tuple[bytes, bytes]]
    response: http1.Response | httpx.Response
    url: str

    @property
    def event_stream(self) -> bool:
        """Tell whether the body is an SSE stream."""
        return b"text/event-stream" in dict(self.headers).get(b"content-type", b"")

    async def pieces(self, idle: float | None = None) -> AsyncIterator[bytes]:
        """Yield the body as it arrives; an upstream that breaks off or sends nothing for ``idle`` s: UpstreamFailed."""
        url = self.url
        with _mapped(url):
            stream = (self.response.pieces() if isinstance(self.response, http1.Response)
                      else self.response.aiter_raw())
            while True:
                try:
                    async with asyncio.timeout(idle):
                        piece = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise UpstreamFailed(f"{url}: sent nothing for {idle:g}s (gateway.upstream_idle)") from None
                yield piece

    async def close(self) -> None:
        """Close the upstream's response (its connection is reused if it was read to the end)."""
        await self.response.aclose()


class Upstream:
    """One connection pool for every tenant."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        # No proxy from the environment either way: the tenants are local, and an http_proxy
        # would route them through a proxy that cannot reach them. KEEP_IDLE idle connections in
        # all: a new local connection costs ~0.1 ms, and a burst past 8 opens the rest and lets
        # them go after (httpcore's pool, used before, also slowed with every idle one it held:
        # encode/httpcore#1035).
        self.lean = http1.Client(KEEP_IDLE, 30.0, CONNECT_S, READ_S, WRITE_S) if transport is None else None
        # ``transport``: a test double (httpx's MockTransport) standing in for the model servers.
        self.client = None if transport is None else httpx.AsyncClient(
            trust_env=False, follow_redirects=False, transport=transport,
            timeout=httpx.Timeout(connect=CONNECT_S, read=READ_S, write=WRITE_S, pool=CONNECT_S),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=KEEP_IDLE, keepalive_expiry=30.0))

    async def open(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Answer:
        """Send a request; return the answer once its status and headers have come."""
        sent = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
        # A GET, HEAD or OPTIONS without a body goes on without one (not with "content-length: 0").
        content = body if body or method not in ("GET", "HEAD", "OPTIONS", "DELETE") else None
        response: http1.Response | httpx.Response
        if self.client is None:
            assert self.lean is not None
            with _mapped(url):
                response = await self.lean.request(method, url, sent, content)
            raw, status = response.headers, response.status
        else:
            request = self.client.build_request(method, url, headers=sent, content=content)
            with _mapped(url):
                response = await self.client.send(request, stream=True)
            raw, status = [(k.lower(), v) for k, v in response.headers.raw], response.status_code
        kept = [(k, v) for k, v in raw if k not in HOP_BY_HOP]
        length = next((v for k, v in raw if k == b"content-length"), None)
        if length is not None:
            kept.append((b"content-length", length))
        return Answer(status, kept, response, url)

    async def get_json(self, url: str, timeout: float, authorization: bytes = b"") -> object:
        """GET a JSON document (the resident's model list), with a client's ``Authorization`` if given."""
        headers = [(b"authorization", authorization)] if authorization else []
        with _mapped(url):
            if self.client is None:
                assert self.lean is not None
                try:
                    async with asyncio.timeout(timeout):
                        answer = await self.lean.request("GET", url, headers, None)
                        try:
                            status, body = answer.status, b"".join([p async for p in answer.pieces()])
                        finally:
                            await answer.aclose()
                except TimeoutError:
                    raise http1.Timeout(f"no answer within {timeout:g}s") from None
            else:
                response = await self.client.get(url, timeout=timeout, headers=dict(headers) or None)
                status, body = response.status_code, response.content
        if status != 200:
            raise UpstreamFailed(f"GET {url}: HTTP {status}")
        try:
            return json.loads(body)
        except ValueError:
            raise UpstreamFailed(f"GET {url}: the answer is not JSON") from None

    async def aclose(self) -> None:
        """Close every connection."""
        if self.lean is not None:
            await self.lean.aclose()
        if self.client is not None:
            await self.client.aclose()


@contextlib.contextmanager
def _mapped(url: str) -> Iterator[None]:
    """Turn the client's errors into UpstreamFailed, naming the upstream and what happened."""
    try:
        yield
    except http1.Unreached as err:
        raise UpstreamUnreached(f"{url}: nothing answers ({err})") from err
    except http1.Timeout as err:
        raise UpstreamFailed(f"{url}: no answer in time ({err})") from err
    except http1.HttpError as err:
        raise UpstreamFailed(f"{url}: {err}") from err
    except httpx.ConnectError as err:
        raise UpstreamUnreached(f"{url}: nothing answers ({err or 'connection refused'})") from err
    except httpx.TimeoutException as err:
        raise UpstreamFailed(f"{url}: no answer in time ({type(err).__name__})") from err
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
        raise UpstreamFailed(f"{url}: the server broke off ({err or type(err).__name__})") from err
    except httpx.HTTPError as err:
        raise UpstreamFailed(f"{url}: {err or type(err).__name__}") from err
