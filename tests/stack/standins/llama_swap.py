"""A llama-swap-like proxy in front of one member (the resident llama-server).

    llama_swap.py --listen 127.0.0.1:8090 --upstream http://127.0.0.1:8081 --model strata
                  [--poll 0.25] [--health-timeout 120]

- ``/v1/*`` (any method) is forwarded to the upstream with status and headers kept; responses
  are relayed piece by piece as they arrive (SSE streams are not buffered). If the upstream dies
  mid-response the client gets a truncated response (the connection is closed without the final
  chunk) and the proxy carries on.
- Before forwarding, the member must be healthy: ``GET /health`` on the upstream is polled every
  ``--poll`` seconds (real llama-swap: every second) for up to ``--health-timeout`` seconds (real
  default ``healthCheckTimeout`` 120). Never reachable: 502; reachable but not 200 (llama-server
  says 503 while loading): 503; both with ``{"error": "..."}``.
- A POST whose JSON body names another ``model`` gets 400 ``could not find real modelID for X``
  (a missing model: ``missing or invalid 'model' key``), as llama-swap does.
- ``GET /v1/models`` is answered by the proxy (the member list), ``GET /health`` is 200 ``OK``,
  ``GET /running`` reports the member as ready/starting/stopped from the upstream's health,
  ``GET|POST /unload`` answers 200 ``OK`` and does nothing: systemd, not this proxy, owns the
  llama-server process here (real llama-swap would stop it).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import sys
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank")


@dataclass(frozen=True)
class Config:
    """The proxy's settings."""

    host: str
    port: int
    upstream_host: str
    upstream_port: int
    model: str
    poll: float
    health_timeout: float
    request_timeout: float


def upstream_health(cfg: Config) -> int | None:
    """The status of the upstream's ``/health``, or None if it cannot be reached."""
    conn = http.client.HTTPConnection(cfg.upstream_host, cfg.upstream_port, timeout=2)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def wait_healthy(cfg: Config) -> int | None:
    """Poll the upstream's health until 200 or the timeout; return the last status."""
    deadline = time.monotonic() + cfg.health_timeout
    while True:
        status = upstream_health(cfg)
        if status == 200 or time.monotonic() >= deadline:
            return status
        time.sleep(cfg.poll)


class ProxyHandler(BaseHTTPRequestHandler):
    """Routes of the proxy."""

    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn (vLLM) and Go's net/http (llama-swap) set it: headers and body go out in
    # separate writes, and Nagle's algorithm would hold the body for the client's delayed ACK (40 ms).
    disable_nagle_algorithm = True
    server: ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        """Log to stderr."""
        print(f"[llama-swap] {self.client_address[0]} {format % args}", file=sys.stderr, flush=True)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        """Send a complete response."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        """Send llama-swap's error object."""
        self._send(status, json.dumps({"error": message}).encode(), "application/json")

    def _route(self) -> None:
        """Dispatch every method."""
        cfg = self.server.cfg
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path = urlsplit(self.path).path
        if path == "/health":
            self._send(200, b"OK", "text/plain; charset=utf-8")
        elif path == "/running":
            status = upstream_health(cfg)
            state = "ready" if status == 200 else "stopped" if status is None else "starting"
            proxy = f"http://{cfg.upstream_host}:{cfg.upstream_port}"
            running = {"running": [{"model": cfg.model, "state": state, "proxy": proxy}]}
            self._send(200, json.dumps(running).encode(), "application/json")
        elif path == "/unload":
            self._send(200, b"OK", "text/plain; charset=utf-8")
        elif path == "/v1/models" and self.command == "GET":
            card = {
                "id": cfg.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "llama-swap",
            }
            self._send(
                200, json.dumps({"object": "list", "data": [card]}).encode(), "application/json"
            )
        elif path.startswith("/v1/"):
            if self.command == "POST" and path in MODEL_ROUTES and not self._model_ok(body):
                return
            self._forward(body)
        else:
            self._error(404, f"no route for {path}")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _route

    def _model_ok(self, body: bytes) -> bool:
        """Check the request's model the way llama-swap routes it; answer 400 if not ours."""
        try:
            requested = json.loads(body).get("model")
        except (ValueError, AttributeError):
            self._error(400, "invalid JSON")
            return False
        if not isinstance(requested, str) or not requested:
            self._error(400, "missing or invalid 'model' key")
            return False
        if requested != self.server.cfg.model:
            self._error(400, f"could not find real modelID for {requested}")
            return False
        return True

    def _forward(self, body: bytes) -> None:
        """Wait for the member to be healthy, then relay the request and its response."""
        cfg = self.server.cfg
        status = wait_healthy(cfg)
        if status != 200:
            why = "unreachable" if status is None else f"health {status}"
            code = 502 if status is None else 503
            self._error(
                code, f"upstream {cfg.model} not ready after {cfg.health_timeout:g}s ({why})"
            )
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        conn = http.client.HTTPConnection(
            cfg.upstream_host, cfg.upstream_port, timeout=cfg.request_timeout
        )
        try:
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._error(502, f"upstream request failed: {e}")
                return
            self._relay(resp)
        finally:
            conn.close()

    def _relay(self, resp: http.client.HTTPResponse) -> None:
        """Pass the upstream's response through as it arrives."""
        length = resp.getheader("Content-Length")
        self.send_response_only(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        chunked = length is None
        self.send_header(
            "Transfer-Encoding" if chunked else "Content-Length", "chunked" if chunked else length
        )
        self.end_headers()
        sent = 0
        try:
            while True:
                try:
                    data = resp.read1(65536)
                except (OSError, http.client.HTTPException) as e:
                    self.log_message("upstream broke off mid-response: %r", e)
                    self.close_connection = True
                    return
                if not data:
                    break
                sent += len(data)
                self.wfile.write(
                    f"{len(data):x}\r\n".encode() + data + b"\r\n" if chunked else data
                )
                self.wfile.flush()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            elif sent < int(length or 0):
                self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class ProxyServer(ThreadingHTTPServer):
    """A threaded HTTP server that knows its configuration."""

    daemon_threads = True
    # A burst of clients (a gateway letting its waiting requests through at once) must queue in
    # the kernel, as with a real server's backlog (uvicorn: 2048), not be refused at 5.
    request_queue_size = 1024

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        super().__init__((cfg.host, cfg.port), ProxyHandler)


def parse_args(argv: list[str] | None) -> Config:
    """Build the configuration from the command line."""
    parser = argparse.ArgumentParser(description="llama-swap-like proxy for one member")
    parser.add_argument("--listen", default="127.0.0.1:8090", help="HOST:PORT")
    parser.add_argument("--upstream", default="http://127.0.0.1:8081", help="member base URL")
    parser.add_argument("--model", default="strata", help="member (model) name")
    parser.add_argument("--poll", type=float, default=0.25, help="health poll interval, s")
    parser.add_argument("--health-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    up = urlsplit(args.upstream)
    if not host or not port.isdigit() or up.scheme != "http" or not up.hostname:
        parser.error("--listen HOST:PORT and --upstream http://HOST:PORT are required")
    return Config(
        host,
        int(port),
        up.hostname,
        up.port or 80,
        args.model,
        args.poll,
        args.health_timeout,
        args.request_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Serve until killed."""
    cfg = parse_args(argv)
    server = ProxyServer(cfg)
    print(
        f"[llama-swap] listening on {cfg.host}:{cfg.port}, member {cfg.model} -> "
        f"http://{cfg.upstream_host}:{cfg.upstream_port}",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
