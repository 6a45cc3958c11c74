"""The model servers behind the gateway, over httpx: one request each, the answer passed through as it arrives.

Nothing is buffered: each piece of the upstream's body is handed on as httpx reads it, raw (the
same bytes, so the same SSE framing and the same final ``usage`` chunk). httpx's errors leave
this module as ``UpstreamFailed``, the most specific message first.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx

from gpuswapd.gateway.errors import UpstreamFailed

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
    response: httpx.Response

    @property
    def event_stream(self) -> bool:
        """Tell whether the body is an SSE stream."""
        return b"text/event-stream" in dict(self.headers).get(b"content-type", b"")

    async def pieces(self, idle: float | None = None) -> AsyncIterator[bytes]:
        """Yield the body as it arrives; an upstream that breaks off or sends nothing for ``idle`` s: UpstreamFailed."""
        url = str(self.response.request.url)
        with _mapped(url):
            stream = self.response.aiter_raw()
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
        # trust_env=False: the tenants are local; an http_proxy from the environment would route
        # them through a proxy that cannot reach them. ``transport``: a test double (MockTransport).
        # max_keepalive_connections is kept small: httpcore's pool does work on every request that
        # grows with the square of the connections it holds (encode/httpcore#1035), so 512 idle
        # ones kept after a burst of streams added ~4.4 ms to each request for the next 30 s. A new
        # local connection costs ~0.1 ms; a burst past 8 opens the rest and lets them go after.
        self.client = httpx.AsyncClient(
            trust_env=False, follow_redirects=False, transport=transport,
            timeout=httpx.Timeout(connect=CONNECT_S, read=READ_S, write=WRITE_S, pool=CONNECT_S),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=KEEP_IDLE, keepalive_expiry=30.0))

    async def open(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Answer:
        """Send a request; return the answer once its status and headers have come."""
        sent = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
        # A GET, HEAD or OPTIONS without a body goes on without one (not with "content-length: 0").
        content = body if body or method not in ("GET", "HEAD", "OPTIONS", "DELETE") else None
        request = self.client.build_request(method, url, headers=sent, content=content)
        with _mapped(url):
            response = await self.client.send(request, stream=True)
        kept = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        length = response.headers.get("content-length")
        if length is not None:
            kept.append((b"content-length", length.encode()))
        return Answer(response.status_code, kept, response)

    async def get_json(self, url: str, timeout: float, authorization: bytes = b"") -> object:
        """GET a JSON document (the resident's model list), with a client's ``Authorization`` if given."""
        with _mapped(url):
            response = await self.client.get(url, timeout=timeout,
                                             headers={b"authorization": authorization} if authorization else None)
        if response.status_code != 200:
            raise UpstreamFailed(f"GET {url}: HTTP {response.status_code}")
        try:
            return response.json()
        except ValueError:
            raise UpstreamFailed(f"GET {url}: the answer is not JSON") from None

    async def aclose(self) -> None:
        """Close every connection."""
        await self.client.aclose()


@contextlib.contextmanager
def _mapped(url: str) -> Iterator[None]:
    """Turn httpx's errors into UpstreamFailed, naming the upstream and what happened."""
    try:
        yield
    except httpx.ConnectError as err:
        raise UpstreamFailed(f"{url}: nothing answers ({err or 'connection refused'})") from err
    except httpx.TimeoutException as err:
        raise UpstreamFailed(f"{url}: no answer in time ({type(err).__name__})") from err
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
        raise UpstreamFailed(f"{url}: the server broke off ({err or type(err).__name__})") from err
    except httpx.HTTPError as err:
        raise UpstreamFailed(f"{url}: {err or type(err).__name__}") from err
