"""``GET /metrics`` over TCP, on the daemon's own event loop, within the socket server's caps and timeouts.

It serves nothing else: any other path is 404, any other method 405. Each connection carries one
request and is closed after the reply. Connections count against the same ``Admission`` as the
Unix socket's, all of them as one non-root user: scrapers can never take the places kept for
root and the group.

Its accept loop is not the Unix socket's, on purpose. This one is asyncio's own
(``start_server``), which takes up to its backlog of waiting connections a turn and pauses a
second on EMFILE; the Unix socket's is written out because it asks the kernel who connected
(SO_PEERCRED) and admits or refuses on the bare socket, before any stream is built for it, and
takes at most ``ACCEPT_BATCH`` a turn so a flood cannot starve the clients already admitted.
One loop for both would bend one into the other's shape. What they do share, each connection's
task and its counting out and closing however it ends, is ``gpuswapd.server.clients``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST

from gpuswapd.errors import ConfigError
from gpuswapd.logs import log
from gpuswapd.server.admission import Admission
from gpuswapd.server.clients import Clients
from gpuswapd.server.peers import Peer
from gpuswapd.server.server import BACKLOG, FIRST_REQUEST_S, WRITE_S

MAX_HEAD = 8192
# Every TCP client is this one "user" to the caps: an uid no account has ((uid_t) -1).
NETWORK = Peer(pid=0, uid=2**32 - 1, gid=2**32 - 1)


def split_listen(listen: str) -> tuple[str, int]:
    """Split ``metrics.listen`` (validated by the config) into host and port."""
    host, _, port = listen.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


class ScrapeServer:
    """Serves ``/metrics`` from ``render`` to Prometheus."""

    def __init__(self, listen: str, render: Callable[[], bytes], admission: Admission) -> None:
        self.listen = listen
        self._render = render
        self._admission = admission
        self._server: asyncio.Server | None = None
        self._clients = Clients(admission)

    @property
    def port(self) -> int:
        """Return the port listened on."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Listen; a port that cannot be had is a configuration error (exit 78)."""
        host, port = split_listen(self.listen)
        try:
            self._server = await asyncio.start_server(self._handle, host, port, backlog=BACKLOG, limit=MAX_HEAD,
                                                      reuse_address=True)
        except (OSError, socket.gaierror) as err:
            raise ConfigError(f"metrics.listen: cannot listen on {self.listen}: {err.strerror or err}") from None
        log.info("metrics_listening", listen=self.listen)

    async def close(self) -> None:
        """Stop listening and drop the connections."""
        if self._server is not None:
            self._server.close()
        await self._clients.drop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        refusal = self._admission.admit(NETWORK)
        if refusal is not None:
            writer.write(_response(503, "Service Unavailable", refusal.encode() + b"\n", "text/plain"))
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._clients.track(task)
        async with self._clients.serving(NETWORK, writer):
            try:
                await self._serve(reader, writer)
            except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ValueError):
                pass
            except asyncio.CancelledError:
                pass
            except Exception:  # a bug must not take the daemon down with one scrape
                log.exception("metrics_request_crashed")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(FIRST_REQUEST_S):
            head = await reader.readuntil(b"\r\n\r\n")
        method, target = _request_line(head)
        if not method:
            reply = _response(400, "Bad Request", b"not an HTTP request\n", "text/plain")
        elif method not in ("GET", "HEAD"):
            reply = _response(405, "Method Not Allowed", b"only GET /metrics\n", "text/plain", allow="GET, HEAD")
        elif target.split("?", 1)[0] != "/metrics":
            reply = _response(404, "Not Found", b"only /metrics\n", "text/plain")
        else:
            body = self._render()
            reply = _response(200, "OK", body, CONTENT_TYPE_LATEST, head_only=method == "HEAD")
        writer.write(reply)
        await asyncio.wait_for(writer.drain(), WRITE_S)


def _request_line(head: bytes) -> tuple[str, str]:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1]


def _response(code: int, reason: str, body: bytes, content_type: str, allow: str | None = None,
              head_only: bool = False) -> bytes:
    headers = [f"HTTP/1.1 {code} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
               "Connection: close"]
    if allow is not None:
        headers.append(f"Allow: {allow}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + (b"" if head_only else body)
