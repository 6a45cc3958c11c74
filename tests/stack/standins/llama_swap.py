"""A llama-swap-like proxy in front of one member (the resident llama-server).

    llama_swap.py --listen 127.0.0.1:8090 --upstream http://127.0.0.1:8081 --model strata
                  [--poll 0.25] [--health-timeout 120] [--control DIR]

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
- llama-swap's other routes: the model routes of llama.cpp's server (``/infill``, ``/completion``,
  ``/rerank``, ``/reranking``) are forwarded like ``/v1/*``; ``/v1/audio/*`` (a multipart form,
  routed by its ``model`` field) and ``/v1/images/*`` are answered by the proxy itself (the member
  has none); ``/upstream/{model}/PATH`` is forwarded to the member as ``/PATH``; ``/logs``,
  ``/ui`` answer text and HTML, ``/api/events`` and ``/logs/stream`` are SSE streams that never
  end (a comment each second); ``OPTIONS`` on any path is CORS's preflight answer, 204. Every
  answer of the proxy's own carries ``X-Llama-Swap-Saw: <the request target>``, query and all.
- ``--control DIR``: ``DIR/llama-swap.json`` is read on every request (a test writes it):
  ``{"aliases": [...], "models": [...], "api_keys": [...]}``: more names for the member (models
  are listed by ``/v1/models``, aliases too, as with ``includeAliasesInList``; a request for one
  goes to the member with its own name, as with ``useModelName``), and llama-swap's
  ``apiKeys``: with any, the model routes and ``/v1/models`` need ``Authorization: Bearer KEY``
  (or ``x-api-key``) and answer 401 otherwise.
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
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/reranking",
                "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/infill", "/completion", "/rerank",
                "/reranking")
CONTROL_FILE = "llama-swap.json"


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
    control: str | None = None

    def extra(self) -> dict[str, list[str]]:
        """Read what a test set: more names for the member, and API keys."""
        if self.control is None:
            return {}
        try:
            with open(f"{self.control}/{CONTROL_FILE}", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: [str(x) for x in v] for k, v in data.items() if isinstance(v, list)}

    def names(self) -> list[str]:
        """Every name the member answers to: its model, the models added, the aliases."""
        extra = self.extra()
        return [self.model, *extra.get("models", []), *extra.get("aliases", [])]


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
        self.send_header("X-Llama-Swap-Saw", self.path)
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
        keys = cfg.extra().get("api_keys", [])
        if self.command == "OPTIONS":
            self.send_response(204)
            self.send_header("X-Llama-Swap-Saw", self.path)
            self.send_header("Access-Control-Allow-Origin", self.headers.get("Origin") or "*")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, PUT, PATCH, DELETE, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization, Accept, X-Requested-With")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif keys and (path in MODEL_ROUTES or path == "/v1/models" or path.startswith(("/v1/audio/", "/upstream/")))\
                and not self._key_ok(keys):
            self._error(401, "unauthorized: invalid or missing API key")
        elif path == "/health":
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
            cards = [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "llama-swap"}
                     for name in cfg.names()]
            self._send(200, json.dumps({"object": "list", "data": cards}).encode(), "application/json")
        elif path.startswith("/v1/audio/") or path.startswith("/v1/images/"):
            self._media(path, body)
        elif path.startswith("/upstream/"):
            model, _, rest = path.removeprefix("/upstream/").partition("/")
            if model not in cfg.names():
                self._error(404, f"model {model} not found")
                return
            query = urlsplit(self.path).query
            self.path = "/" + rest + ("?" + query if query else "")
            self._forward(body)
        elif path in ("/api/events", "/logs/stream"):
            self._endless()
        elif path == "/logs":
            self._send(200, b"[llama-swap] the proxy's log\n", "text/plain; charset=utf-8")
        elif path == "/ui" or path.startswith("/ui/"):
            self._send(200, b"<!doctype html><title>llama-swap</title>", "text/html; charset=utf-8")
        elif path.startswith("/v1/") or path in MODEL_ROUTES:
            if self.command == "POST" and path in MODEL_ROUTES:
                if not self._model_ok(body):
                    return
                body = self._real_name(body)
            self._forward(body)
        else:
            self._error(404, f"no route for {path}")

    def _real_name(self, body: bytes) -> bytes:
        """Name the member's own model in the body, as llama-swap's ``useModelName`` does for its other names."""
        data = json.loads(body)
        if data.get("model") == self.server.cfg.model:
            return body
        return json.dumps({**data, "model": self.server.cfg.model}).encode()

    def _key_ok(self, keys: list[str]) -> bool:
        """Check llama-swap's apiKeys: a Bearer token or x-api-key."""
        auth = self.headers.get("Authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else self.headers.get("x-api-key")
        return given in keys

    def _media(self, path: str, body: bytes) -> None:
        """Answer an audio or image request (the member has none), routed by its model as llama-swap does."""
        kind = self.headers.get("Content-Type", "")
        model: str | None = None
        if kind.startswith("multipart/form-data"):
            for part in body.split(b"\r\n--"):
                head, _, value = part.partition(b"\r\n\r\n")
                if b'name="model"' in head and b"filename=" not in head:
                    model = value.split(b"\r\n")[0].decode(errors="replace")
        else:
            with contextlib.suppress(ValueError, AttributeError):
                model = json.loads(body).get("model")
        if not model:
            self._error(400, "missing or invalid 'model' key")
        elif model not in self.server.cfg.names():
            self._error(400, f"could not find real modelID for {model}")
        else:
            self._send(200, json.dumps({"text": f"{len(body)} bytes heard", "model": model, "path": path}).encode(),
                       "application/json")

    def _endless(self) -> None:
        """An SSE stream that never ends: a comment every second, until the client goes."""
        self.send_response(200)
        self.send_header("X-Llama-Swap-Saw", self.path)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                data = b": llama-swap\n\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:
            self.close_connection = True

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
        if requested not in self.server.cfg.names():
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
    parser.add_argument("--control", help="a directory with llama-swap.json (aliases, models, api_keys)")
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
        args.control,
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
