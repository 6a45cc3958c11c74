"""The gateway's ASGI application: llama-swap's routes, routed by ``model``, and the gateway's own.

    POST /v1/chat/completions, /v1/messages, ...  to the tenant that serves the model (routes.py lists them)
    ANY  /upstream/{model}/...   to that model's tenant
    GET  /v1/models              every model of every tenant, with "tenant" and "on_card"
    GET  /health                 the gateway's own health
    GET  /metrics                Prometheus
    GET  /gpuswapd/in-flight     resident requests in flight ([resident.idle] kind = "gateway")
    ANY  /unload                 refused: llama-swap would stop the resident behind gpuswapd's back
    ANY  anything else           to llama-swap (the resident) unchanged, query string and all

A model the gateway does not know is looked up in llama-swap's ``/v1/models``, asked with the
client's own ``Authorization`` (llama-swap's ``apiKeys``), before it is a 404.

A streaming request that must wait for its window gets its response started at once, and an SSE
comment every few seconds (``: gpuswapd BOOTING 35s``); if its window then fails, or ``hold``
passes, it gets an SSE error event (``data: {"error": {...}}``) and the end of the stream. Every
other failure before the answer starts is an HTTP status with OpenAI's error object. A client that
hangs up is noticed at once: its request withdraws from the wait, and its upstream request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from gpuswapd import __version__, clock
from gpuswapd.config import GATEWAY_IN_FLIGHT_PATH, Config
from gpuswapd.errors import GpuswapError
from gpuswapd.gateway.demand import Demand, Flight
from gpuswapd.gateway.errors import (
    BodiesFull,
    BodyTooLarge,
    ClientTooSlow,
    GatewayError,
    Refused,
    TooManyWaiting,
    Unavailable,
    UnknownModel,
    UpstreamFailed,
)
from gpuswapd.gateway.follow import Follow
from gpuswapd.gateway.meters import PASSED, UNKNOWN_MODEL, Meters
from gpuswapd.gateway.routes import (
    REFUSED,
    UPSTREAM_PREFIX,
    anthropic,
    asked,
    error_body,
    retry_after,
    routed_by_model,
    shown,
    sse_error,
)
from gpuswapd.gateway.tenants import RESIDENT, Tenant, Tenants
from gpuswapd.gateway.upstream import WRITE_S, Answer, Upstream
from gpuswapd.logs import log
from gpuswapd.tasks import in_daemon_thread, reap, spawn, uncancel

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

BODY_S = 60.0  # the whole request body must arrive within this
MODELS_FRESH_S = 10.0  # the resident's model list is read again at most this often
UNKNOWN_FRESH_S = 1.0  # an unknown name asks llama-swap's list again at most this often (per Authorization)
RETRY_S = 5  # Retry-After of a 429 or 503 that knows no better
LISTED = 20  # a 404 names at most this many models
HELD = "gpuswapd.held"  # in an ASGI scope: the bytes of its body counted against gateway.max_bodies
SAVE_S = 5.0
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
       (b"x-accel-buffering", b"no")]


@dataclass(eq=False)
class Call:
    """One client request on its way: what it asked, and how far its answer has come."""

    send: Send
    model: str
    tenant: Tenant | None = None
    stream: bool = False
    anthropic: bool = False  # the route speaks Anthropic's Messages API: its errors take that shape
    started: bool = False  # the response has started (status and headers sent)
    gone: bool = False  # the client hung up
    finished: bool = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status and headers."""
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = True) -> None:
        """Send a piece of the body."""
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def _send(self, message: Message) -> None:
        # A client that stops reading must not hold its request for ever.
        try:
            async with asyncio.timeout(WRITE_S):
                await self.send(message)
        except TimeoutError:
            raise NotReading(f"the client read nothing of its answer for {WRITE_S:g}s: cut") from None


class Gateway:
    """The ASGI application."""

    def __init__(self, config: Config, demand: Demand, follow: Follow, tenants: Tenants, upstream: Upstream,
                 meters: Meters) -> None:
        self.config = config
        self.demand = demand
        self.follow = follow
        self.tenants = tenants
        self.upstream = upstream
        self.meters = meters
        self._models_read = -MODELS_FRESH_S
        self._unknown_asked: dict[bytes, float] = {}  # Authorization -> when an unknown name last asked
        self._asking = asyncio.Lock()
        self.bodies = 0  # the bytes of request bodies held now (gateway.max_bodies)
        self._following: asyncio.Task[None] | None = None
        follow.listeners.append(self._event)

    # -- lifespan ------------------------------------------------------------------------------

    async def startup(self) -> None:
        """Follow gpuswapd, give back what an earlier gateway left, learn the resident's names."""
        self._following = spawn(self.follow.run(), "gateway-follow")
        await self.demand.start()
        spawn(self._learn_models(), "gateway-models")

    async def shutdown(self) -> None:
        """Give back the gateway's leases and close the upstream connections."""
        await self.demand.close()
        await reap(self._following)
        await self.upstream.aclose()

    # -- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        by_model = routed_by_model(method, path)
        try:
            if by_model:
                await self._model_request(scope, receive, send)
            elif path == "/v1/models" and method == "GET":
                await _json(send, 200, await self._models())
            elif path == "/health" and method == "GET":
                await _json(send, 200, {"status": "ok", "version": __version__, "gpuswapd": self.follow.reachable,
                                        "phase": self.follow.phase, "waiting": self.demand.waiting,
                                        "resident_in_flight": self.demand.resident_in_flight()})
            elif path == "/metrics" and method == "GET":
                await _reply(send, 200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                             self.meters.render())
            elif path == GATEWAY_IN_FLIGHT_PATH and method == "GET":
                await self._in_flight(scope, send)
            elif path in REFUSED:
                raise Refused(f"{method} {path} is not passed to llama-swap: it would stop the resident behind "
                              "gpuswapd's back; to have the card, acquire a lease (gpuswapctl acquire)")
            elif path.startswith(UPSTREAM_PREFIX):
                await self._upstream_request(scope, receive, send)
            else:
                await self._passed(scope, receive, send)
        except _Gone:
            return
        except GatewayError as err:
            if not isinstance(err, UnknownModel):
                self.meters.requests.labels(UNKNOWN_MODEL if by_model else PASSED, "none", _outcome(err)).inc()
            await _error(send, err, anthropic(path))
        finally:
            self.bodies -= scope.pop(HELD, 0)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as err:  # uvicorn stops and exits: say why
                    log.exception("gateway_startup_failed", error=repr(err))
                    await send({"type": "lifespan.startup.failed", "message": repr(err)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- the model routes ----------------------------------------------------------------------

    async def _model_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await self._read_body(scope, receive)
        what = asked(raw, _header(scope, b"content-type"))
        tenant = await self._tenant(what.model, scope)
        call = Call(send, what.model, tenant, stream=what.stream, anthropic=anthropic(scope["path"]))
        await self._forward(call, scope, receive, tenant.base + _target(scope), raw, work=True)

    async def _upstream_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/upstream/{model}/...``: the resident's to llama-swap unchanged, an engine's as ``/...`` to it."""
        raw = await self._read_body(scope, receive)
        target = _target(scope)
        rest = target[len(UPSTREAM_PREFIX):]
        names = sorted((name for name, _ in self.tenants.served()), key=len, reverse=True)
        model = next((n for n in names if rest == n or rest.startswith((n + "/", n + "?"))), None)
        if model is None:  # a name llama-swap may know: it answers for it (a 404 if it does not)
            model = rest.split("/", 1)[0].split("?", 1)[0]
            tenant = await self._known(model, scope) or self.tenants.resident
        else:
            tenant = await self._tenant(model, scope)
        url = tenant.base + ("/" + rest[len(model):].lstrip("/") if tenant.engine else target)
        call = Call(send, model, tenant, stream=False, anthropic=anthropic(scope["path"]))
        await self._forward(call, scope, receive, url, raw, work=True)

    async def _passed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Any other route: to llama-swap unchanged; it waits for the resident but never holds a drain."""
        raw = await self._read_body(scope, receive)
        call = Call(send, PASSED, self.tenants.resident)
        await self._forward(call, scope, receive, self.tenants.resident.base + _target(scope), raw, work=False)

    async def _tenant(self, model: str, scope: Scope) -> Tenant:
        """Return the model's tenant, or raise UnknownModel naming the served models."""
        tenant = await self._known(model, scope)
        if tenant is not None:
            return tenant
        self.meters.requests.labels(UNKNOWN_MODEL, "none", "client_error").inc()
        served = [name for name, _ in self.tenants.served()]
        more = f" and {len(served) - LISTED} more" if len(served) > LISTED else ""
        raise UnknownModel(f"the model {shown(model)!r} is not served here; the models are: "
                           f"{', '.join(served[:LISTED])}{more} (GET /v1/models)", param="model")

    async def _known(self, model: str, scope: Scope) -> Tenant | None:
        """Return the model's tenant; a name not known yet is looked up in llama-swap's list first."""
        tenant = self.tenants.route(model)
        if tenant is None and self.follow.resident_serves():
            auth = _header(scope, b"authorization")
            async with self._asking:
                tenant = self.tenants.route(model)
                if tenant is None and clock.monotonic() - self._unknown_asked.get(auth, -UNKNOWN_FRESH_S) >= \
                        UNKNOWN_FRESH_S:
                    if len(self._unknown_asked) > 64:
                        self._unknown_asked.clear()  # a client cannot grow it without bound
                    self._unknown_asked[auth] = clock.monotonic()
                    await self._learn_models(auth)
                    tenant = self.tenants.route(model)
        return tenant

    async def _forward(self, call: Call, scope: Scope, receive: Receive, url: str, raw: bytes, work: bool) -> None:
        """Serve the request from ``url`` once its tenant may be served; count its outcome."""
        tenant = call.tenant
        assert tenant is not None
        task = asyncio.current_task()
        assert task is not None
        # Nothing more comes from the client but its hang-up: that ends the request at once.
        watcher = spawn(_until_gone(receive, call, task), "gateway-client")
        outcome = "ok"
        try:
            outcome = await self._serve(call, scope, url, raw, work)
        except asyncio.CancelledError:
            if not call.gone:
                raise
            uncancel()
            outcome = "gone"
        except NotReading as err:
            outcome = "not_reading"
            log.info("gateway_client_cut", model=shown(call.model), tenant=tenant.name, error=str(err))
            raise  # uvicorn drops the connection (main.py keeps it out of the log)
        except GatewayError as err:
            outcome = _outcome(err)
            await self._fail(call, err)
        finally:
            call.finished = True
            watcher.cancel()
            self.meters.requests.labels(call.model, tenant.name, outcome).inc()

    async def _serve(self, call: Call, scope: Scope, url: str, raw: bytes, work: bool) -> str:
        assert call.tenant is not None
        tell = self._heartbeat(call) if call.stream else _quiet
        async with self.demand.serving(call.tenant, tell) as flight:
            if not work:  # passed through: waits for the resident like its work, but holds no drain
                self.demand.resident_flights.discard(flight)
            answer = await self.upstream.open(scope["method"], url, scope["headers"], raw)
            try:
                return await self._relay(call, answer, flight)
            finally:
                await answer.close()

    async def _relay(self, call: Call, answer: Answer, flight: Flight) -> str:
        """Pass the answer through; an upstream that breaks off ends an SSE stream with an error event."""
        if call.started:  # the wait started the stream: the status is said, only the body follows
            if answer.status != 200:
                body = await _read_some(answer)
                raise UpstreamFailed(f"{call.tenant.name if call.tenant else '?'} answered HTTP {answer.status}: "
                                     f"{body.decode(errors='replace')[:500]}")
        elif answer.status >= 500 and not (answer.event_stream or b"json" in _content_type(answer)):
            # An upstream's own error page (HTML, text): the client gets an error it can parse.
            body = await _read_some(answer)
            failed = UpstreamFailed(f"{call.tenant.name if call.tenant else '?'} answered HTTP {answer.status}: "
                                    f"{body.decode(errors='replace')[:500]}",
                                    retry_after=RETRY_S if answer.status == 503 else None)
            failed.status = answer.status
            raise failed
        else:
            headers = answer.headers
            if answer.status in (429, 503) and not any(k == b"retry-after" for k, _ in headers):
                headers = [*headers, (b"retry-after", str(RETRY_S).encode())]
            await call.start(answer.status, headers)
        task = asyncio.current_task()
        assert task is not None
        flight.on_cut = task.cancel
        try:
            async for piece in answer.pieces(self.config.gateway.upstream_idle):
                await call.body(piece)
        except asyncio.CancelledError:
            if flight.cut is None:
                raise
            uncancel()
            raise Unavailable(flight.cut) from None
        except UpstreamFailed as err:
            if not (call.stream or answer.event_stream):
                raise _Truncated(err.message) from err  # a JSON answer cut short cannot be mended: drop the connection
            raise
        finally:
            flight.on_cut = None
        await call.body(b"", more=False)
        return "ok" if answer.status < 400 else "client_error" if answer.status < 500 else "upstream_error"

    def _heartbeat(self, call: Call) -> Callable[[str, float], Awaitable[None]]:
        async def tell(phase: str, waited: float) -> None:
            if not call.started:
                await call.start(200, SSE)
            await call.body(f": gpuswapd {phase} {waited:.0f}s\n\n".encode())
        return tell

    async def _fail(self, call: Call, err: GatewayError) -> None:
        """Tell the client: an HTTP error before the answer started, an SSE error event after."""
        log.info("gateway_request_failed", model=call.model, tenant=call.tenant.name if call.tenant else None,
                 code=err.code, error=err.message)
        if call.gone:
            return
        if isinstance(err, _Truncated):
            raise err  # uvicorn drops the connection: the client sees the answer end short
        if not call.started:
            await _error(call.send, err, call.anthropic)
            return
        with contextlib.suppress(Exception):
            await call.body(sse_error(err, call.anthropic), more=False)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.gateway.max_body
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"the body is {int(declared)} bytes, over gateway.max_body = {limit} bytes")
        budget = self.config.gateway.max_bodies
        # Counted twice: the pieces as they come, and the body they are joined into.
        if declared is not None and declared.isdigit():
            self._hold(scope, 2 * int(declared), budget)  # the whole of it, before a byte is read
        pieces: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(BODY_S):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Gone()  # nobody to answer
                    piece = message.get("body", b"")
                    size += len(piece)
                    if size > limit:
                        raise BodyTooLarge(f"the body is over gateway.max_body = {limit} bytes")
                    if 2 * size > scope.get(HELD, 0):
                        self._hold(scope, 2 * size - scope.get(HELD, 0), budget)
                    pieces.append(piece)
                    if not message.get("more_body"):
                        return b"".join(pieces)
        except TimeoutError:
            raise ClientTooSlow(f"the request body did not arrive within {BODY_S:g}s") from None

    def _hold(self, scope: Scope, size: int, budget: int) -> None:
        """Count ``size`` more bytes of this request's body against gateway.max_bodies, or refuse it (503)."""
        if self.bodies + size > budget:
            raise BodiesFull(f"the gateway holds {self.bodies} bytes of request bodies already (gateway.max_bodies = "
                             f"{budget} bytes): try again shortly", retry_after=RETRY_S)
        self.bodies += size
        scope[HELD] = scope.get(HELD, 0) + size

    # -- the gateway's own routes --------------------------------------------------------------

    async def _in_flight(self, scope: Scope, send: Send) -> None:
        if b"draining=1" in scope.get("query_string", b""):
            self.follow.mark_draining()
            spawn(self._check_drain(), "gateway-drain-check")
        await _json(send, 200, {"resident_in_flight": self.demand.resident_in_flight(),
                                "waiting": self.demand.waiting})

    async def _check_drain(self) -> None:
        """Drop a drain mark that gpuswapd does not confirm (anyone local may ask that route)."""
        with contextlib.suppress(GpuswapError):
            status = await self.demand.daemon.request({"op": "status"})
            if status.get("window") is None:
                self.follow.take_status(status)
                self.follow.take({"event": "window_finished"})

    async def _models(self) -> dict[str, Any]:
        if self.follow.resident_serves() and clock.monotonic() - self._models_read > MODELS_FRESH_S:
            await self._learn_models()
        window: dict[str, Any] = {}
        with contextlib.suppress(GpuswapError):
            if self.follow.reachable:
                window = (await self.demand.daemon.request({"op": "status"})).get("window") or {}
        ready = window.get("profile") if window.get("phase") == "READY" else None
        data = []
        for name, tenant in self.tenants.served():
            on_card = self.follow.resident_serves() if tenant.name == RESIDENT else tenant.name == ready
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "gpuswapd-gateway",
                         "tenant": tenant.name, "on_card": on_card})
        return {"object": "list", "data": data}

    async def _learn_models(self, authorization: bytes = b"") -> None:
        """Read the resident's model names from its ``/v1/models``, while it serves (as the client, if given)."""
        if not self.follow.resident_serves():
            return
        self._models_read = clock.monotonic()
        url = f"{self.tenants.resident.base}/v1/models"
        try:
            listing = await self.upstream.get_json(url, timeout=5.0, authorization=authorization)
        except GatewayError as err:
            log.info("gateway_resident_models_unread", url=url, error=err.message)
            return
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list):
            return
        if self.tenants.learn([str(e["id"]) for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]):
            # Off the event loop, and never waited for long: a hung disk must not hold the requests.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAVE_S):
                    await in_daemon_thread(self.tenants.save, name="gateway-save-models")

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "window_finished" and not event.get("switched_to"):
            spawn(self._learn_models(), "gateway-models")


class _Gone(Exception):
    """The client hung up before its request was read."""


class _Truncated(UpstreamFailed):
    """A non-SSE answer broke off after it started: the connection is dropped."""


class NotReading(Exception):
    """The client stopped reading its answer: the connection is dropped."""


DROPPED = (_Truncated, NotReading)  # raised to uvicorn on purpose, to drop the connection


async def _quiet(_phase: str, _waited: float) -> None:
    """Send nothing while a non-streaming request waits."""


async def _until_gone(receive: Receive, call: Call, task: asyncio.Task[Any]) -> None:
    """Cancel the request when its client hangs up (uvicorn says http.disconnect)."""
    while not call.finished:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not call.finished:
                call.gone = True
                task.cancel()
            return


def _content_type(answer: Answer) -> bytes:
    return next((v.lower() for k, v in answer.headers if k == b"content-type"), b"")


def _header(scope: Scope, name: bytes) -> bytes:
    """Return the first header ``name`` (lower case) of the request, or b""."""
    return next((v for k, v in scope["headers"] if k.lower() == name), b"")


def _target(scope: Scope) -> str:
    """Return the request's path as the client sent it, with its query string."""
    raw = scope.get("raw_path")
    path: str = raw.decode("latin-1") if raw else scope["path"]
    query = scope.get("query_string", b"")
    return path + ("?" + query.decode("latin-1") if query else "")


async def _read_some(answer: Answer, limit: int = 4096) -> bytes:
    out = b""
    with contextlib.suppress(UpstreamFailed):
        async for piece in answer.pieces():
            out += piece
            if len(out) >= limit:
                break
    return out


def _outcome(err: GatewayError) -> str:
    if isinstance(err, TooManyWaiting):
        return "too_many"
    if isinstance(err, Unavailable):
        return "cut" if "preempted" in err.message else "unavailable"
    if isinstance(err, UpstreamFailed):
        return "upstream_error"
    if isinstance(err, ClientTooSlow):
        return "client_slow"
    return "client_error" if err.status < 500 else "unavailable"


async def _reply(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    await _reply(send, status, JSON, json.dumps(body).encode())


async def _error(send: Send, err: GatewayError, anthropic_shape: bool = False) -> None:
    headers = list(JSON)
    if (after := retry_after(err, RETRY_S)) is not None:
        headers.append((b"retry-after", str(after).encode()))
    await _reply(send, err.status, headers, json.dumps(error_body(err, anthropic_shape)).encode())
