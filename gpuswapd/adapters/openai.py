"""Model servers over HTTP (httpx): health, streamed chat completions, the resident's idle probe.

Speaks to what real servers do: vLLM's OpenAI API (``/health`` 503 after an EngineDeadError, the
usage in a stream's last chunk with ``stream_options.include_usage``, reasoning as
``delta.reasoning``) and llama.cpp's ``llama-server`` (``/health`` 503 while loading, ``/slots``,
``/metrics``), directly or behind llama-swap. One ``ModelHttp`` holds one ``httpx.AsyncClient``
(made on first use, so it belongs to the event loop that first uses it); ``aclose()`` ends it.
Every httpx error leaves this module as the most specific ``EndpointError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx

from gpuswapd import clock
from gpuswapd.adapters.prometheus import scan_prometheus
from gpuswapd.adapters.props import ServerProps, parse_model_ids, parse_props
from gpuswapd.adapters.slots import Slot, SlotFile, parse_slot_file, parse_slots
from gpuswapd.adapters.streams import Completion, CompletionBuilder, ServerFault, SseDecoder, message_of, snip
from gpuswapd.config import CompletionCheck, IdleConfig
from gpuswapd.errors import BadResponse, EndpointError, EndpointTimeout, EndpointUnreachable

RETRY_INTERVAL_S = 0.1
IDLE_TIMEOUT_S = 10.0
_ERROR_BODY_LIMIT = 64 * 1024


@dataclass(frozen=True)
class Busy:
    """Whether the resident has a request in flight, and what the probe saw."""

    busy: bool
    detail: str


class ModelHttp:
    """Talk to model servers: health, completions, and whether the resident is busy."""

    def __init__(self, connect_timeout: float = 2.0) -> None:
        self.connect_timeout = connect_timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # trust_env=False: these servers are local; an http_proxy from the environment would
            # route them through a proxy that cannot reach them.
            self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)
        return self._client

    def _timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=min(self.connect_timeout, seconds))

    async def aclose(self) -> None:
        """Close the connections."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def health(self, url: str, timeout: float = 2.0) -> int:
        """Return the status of GET ``url``; 0 when nothing answers there."""
        return (await self._probe(url, timeout))[0]

    async def _probe(self, url: str, limit: float) -> tuple[int, str]:
        """GET ``url``; return the status and what the body says (0 and why, if no answer)."""
        try:
            with _mapped("GET", url, limit):
                response = await self._http().get(url, timeout=self._timeout(limit))
        except EndpointUnreachable as err:
            return 0, _reason(err)
        except BadResponse as err:
            if isinstance(err.__cause__, httpx.RemoteProtocolError):
                # Docker's port proxy accepts and hangs up while the engine inside still loads.
                return 0, _reason(err)
            raise
        return response.status_code, message_of(response.text)

    async def wait_healthy(
        self,
        url: str,
        timeout: float,
        interval: float = 0.2,
        abort: Callable[[], str | None] | None = None,
    ) -> float:
        """Poll ``url`` until it answers 200; return the seconds waited."""
        started = clock.monotonic()
        deadline = started + timeout
        last = "no answer yet"
        while True:
            if abort is not None and (why := abort()) is not None:
                raise EndpointError(why)
            now = clock.monotonic()
            try:
                status, said = await self._probe(url, max(0.05, min(2.0, deadline - now)))
                last = said if status == 0 else f"HTTP {status}" + (f": {said}" if said else "")
            except EndpointError as err:  # slow or garbled while loading: keep polling
                status, last = -1, _reason(err)
            if status == 200:
                return clock.monotonic() - started
            now = clock.monotonic()
            if now >= deadline:
                raise EndpointTimeout(
                    f"{url} did not answer 200 within {timeout:g}s (last: {last}); "
                    "the server is still loading or has failed: check its log"
                )
            await asyncio.sleep(min(interval, deadline - now))

    async def chat(
        self,
        url: str,
        model: str,
        prompt: str | list[dict[str, Any]],
        max_tokens: int,
        timeout: float,
        sampling: dict[str, Any] | None = None,
    ) -> Completion:
        """Stream one chat completion of a prompt or a message list (bounded by ``timeout``).

        ``sampling`` adds request fields such as ``temperature`` and ``seed``.
        """
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(sampling or {}),
        }
        got = CompletionBuilder(clock.monotonic(), f"POST {url}")
        try:
            with _mapped("POST", url, timeout):
                async with asyncio.timeout(timeout):
                    await self._stream(url, body, timeout, got)
        except EndpointTimeout as err:
            first = "" if got.ttft_s is None else f", the first after {got.ttft_s:.1f}s"
            raise EndpointTimeout(
                f"{err.message} ({got.chunks} chunks so far{first}); the server is slow or "
                "stuck: check its log, or raise the timeout"
            ) from err
        return got.build(clock.monotonic())

    async def _stream(
        self, url: str, body: dict[str, Any], seconds: float, got: CompletionBuilder
    ) -> None:
        """Send the request and feed every chunk of the answer to ``got``."""
        headers = {"Accept": "text/event-stream"}
        request = self._http().stream(
            "POST", url, json=body, headers=headers, timeout=self._timeout(seconds)
        )
        async with request as response:
            if response.status_code != 200:
                await _raise_status("POST", url, response)
            if "text/event-stream" not in response.headers.get("content-type", ""):
                # A server that ignored stream=true answers with one JSON object.
                got.add(_json_object(await response.aread(), got.where), clock.monotonic())
                return
            decoder = SseDecoder(got.where)
            async for line in response.aiter_lines():
                for chunk in decoder.line(line):
                    got.add(chunk, clock.monotonic())
                if decoder.done:
                    return
            for chunk in decoder.end():
                got.add(chunk, clock.monotonic())
        if got.finish_reason is None:
            raise BadResponse(
                f"{got.where}: the stream ended without [DONE] or a finish_reason after "
                f"{got.chunks} chunks (the server broke off mid-answer)"
            ) from ServerFault()

    async def verify(self, check: CompletionCheck, retry_until: float | None = None,
                     fields: dict[str, Any] | None = None) -> Completion:
        """Get a real answer for ``check``; retry failures that may pass until ``retry_until``.

        ``fields`` adds request fields (llama.cpp's ``id_slot``, say).
        """
        reply = await self._answer(check, retry_until, fields)
        if reply.answered:
            return reply
        if reply.finish_reason == "length" and reply.reasoning:
            raise BadResponse(
                f"POST {check.url}: model {check.model} spent all max_tokens = {check.max_tokens} "
                f"thinking ({len(reply.reasoning)} characters of reasoning, no answer); "
                "raise max_tokens for this check"
            )
        if reply.finish_reason == "length":
            raise BadResponse(
                f"POST {check.url}: model {check.model} hit max_tokens = {check.max_tokens} "
                "before any answer; raise max_tokens for this check"
            )
        raise BadResponse(
            f"POST {check.url}: model {check.model} gave an empty answer "
            f"(finish_reason {reply.finish_reason}, {reply.completion_tokens} tokens)"
        )

    async def _answer(self, check: CompletionCheck, retry_until: float | None,
                      fields: dict[str, Any] | None = None) -> Completion:
        """Run the check's completion, again every 0.1 s while it fails in a passing way."""
        started = clock.monotonic()
        tries = 0
        while True:
            tries += 1
            try:
                return await self.chat(
                    check.url, check.model, check.prompt, check.max_tokens, check.timeout, fields
                )
            except EndpointError as err:
                now = clock.monotonic()
                if retry_until is None or now >= retry_until or not _worth_retrying(err):
                    if tries == 1:
                        raise
                    raise type(err)(
                        f"{err.message} (tried {tries} times over {now - started:.1f}s)"
                    ) from err
                await asyncio.sleep(min(RETRY_INTERVAL_S, retry_until - now))

    async def is_sleeping(self, base: str, timeout: float) -> bool | None:
        """Ask vLLM's ``GET /is_sleeping``; None when the server does not offer sleep mode (404)."""
        url = f"{base}/is_sleeping"
        with _mapped("GET", url, timeout):
            response = await self._http().get(url, timeout=self._timeout(timeout))
        if response.status_code in (404, 405):
            return None
        if response.status_code != 200:
            await _raise_status("GET", url, response)
        value = _json_object(response.content, f"GET {url}").get("is_sleeping")
        if not isinstance(value, bool):
            raise BadResponse(f"GET {url}: no is_sleeping true/false in {snip(response.content)}")
        return value

    async def sleep(self, base: str, level: int, timeout: float) -> None:
        """Put vLLM to sleep (``POST /sleep?level=N``; it answers once asleep)."""
        await self._post(f"{base}/sleep?level={level}", timeout)

    async def wake_up(self, base: str, timeout: float) -> None:
        """Wake vLLM (``POST /wake_up``; it answers once its memory is back)."""
        await self._post(f"{base}/wake_up", timeout)

    async def _post(self, url: str, timeout: float) -> None:
        with _mapped("POST", url, timeout):
            response = await self._http().post(url, timeout=self._timeout(timeout))
        if response.status_code != 200:
            await _raise_status("POST", url, response)

    async def props(self, url: str, timeout: float) -> ServerProps:
        """Read llama-server's ``GET /props``: its context per slot, its slots, its model."""
        return parse_props(await self._get(url, timeout), f"GET {url}")

    async def model_ids(self, url: str, timeout: float) -> list[str]:
        """Read the sorted model ids of ``GET /v1/models``."""
        return parse_model_ids(await self._get(url, timeout), f"GET {url}")

    async def slots(self, url: str, timeout: float) -> list[Slot]:
        """Read llama-server's ``GET /slots``: each slot's context, cached tokens and whether it works."""
        return parse_slots(await self._get(url, timeout), f"GET {url}")

    async def slot_file(self, url: str, slot: int, action: str, filename: str, timeout: float) -> SlotFile:
        """Save a slot's cache to a file of the server's save path, or restore it (``action``: save, restore)."""
        where = f"{url}/{slot}?action={action}"
        with _mapped("POST", where, timeout):
            response = await self._http().post(where, json={"filename": filename}, timeout=self._timeout(timeout))
        if response.status_code != 200:
            hint = "start llama-server with --slot-save-path DIR" if response.status_code == 501 else ""
            await _raise_status("POST", where, response, hint=hint)
        return parse_slot_file(response.content, f"POST {where}", action == "save")

    async def _get(self, url: str, timeout: float) -> bytes:
        with _mapped("GET", url, timeout):
            response = await self._http().get(url, timeout=self._timeout(timeout))
        if response.status_code != 200:
            await _raise_status("GET", url, response)
        return response.content

    async def idle(self, idle: IdleConfig, timeout: float = IDLE_TIMEOUT_S, draining: bool = False) -> Busy:
        """Ask the resident whether a request is in flight, the way ``idle.kind`` says.

        ``draining``: a window is draining the resident (not a dry run); the gateway then holds new
        resident requests until the window has passed.
        """
        if idle.kind == "none":
            return Busy(False, "no idle probe (kind = none)")
        if idle.kind == "command":
            return await _run_idle_command(idle.command, timeout)
        if idle.kind not in ("llama.cpp-slots", "prometheus", "gateway"):
            raise ValueError(f"unknown idle probe kind {idle.kind!r}")
        url = idle.url + ("?draining=1" if draining and idle.kind == "gateway" else "")
        with _mapped("GET", url, timeout):
            # Connection: close: an idle keep-alive connection makes llama-server take ~0.1 s
            # longer to exit when the window stops it right after this probe.
            response = await self._http().get(url, timeout=self._timeout(timeout),
                                              headers={"Connection": "close"})
        if response.status_code == 501 and idle.kind == "llama.cpp-slots":
            await _raise_status(
                "GET",
                idle.url,
                response,
                hint=(
                    "start llama-server with --slots, or probe its --metrics with "
                    'resident.idle.kind = "prometheus"'
                ),
            )
        if response.status_code != 200:
            await _raise_status("GET", idle.url, response)
        if idle.kind == "llama.cpp-slots":
            return _slots_busy(idle.url, response.content)
        if idle.kind == "gateway":
            return _gateway_busy(idle.url, response.content)
        return _gauge_busy(idle.url, idle.metric, response.text)


def _slots_busy(url: str, raw: bytes) -> Busy:
    """Read llama.cpp's ``/slots``: busy if any slot is processing."""
    slots = _json(raw, f"GET {url}")
    if not isinstance(slots, list):
        raise BadResponse(f"GET {url}: expected a JSON list of slots, got {snip(raw)}")
    busy = 0
    for n, slot in enumerate(slots):
        if isinstance(slot, dict) and "is_processing" in slot:
            busy += bool(slot["is_processing"])
        elif isinstance(slot, dict) and isinstance(slot.get("state"), int):
            busy += slot["state"] != 0  # llama.cpp before is_processing: 0 means idle
        else:
            raise BadResponse(
                f"GET {url}: slot {n} has no is_processing: is this llama-server's /slots? "
                f"({snip(json.dumps(slot))})"
            )
    return Busy(busy > 0, f"{busy} of {len(slots)} slots processing")


def _gateway_busy(url: str, raw: bytes) -> Busy:
    """Read gpuswapd-gateway's count of resident requests in flight: busy while any is."""
    answer = _json(raw, f"GET {url}")
    count = answer.get("resident_in_flight") if isinstance(answer, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise BadResponse(f"GET {url}: no resident_in_flight count: is this gpuswapd-gateway? ({snip(raw)})")
    return Busy(count > 0, f"{count} resident request(s) in flight through the gateway")


def _gauge_busy(url: str, metric: str, text: str) -> Busy:
    """Read a Prometheus gauge: busy if it is above zero."""
    sums, bad = scan_prometheus(text)
    value = sums.get(metric)
    if value is None:
        unreadable = f"; {len(bad)} lines did not parse, e.g. {snip(bad[0])}" if bad else ""
        raise BadResponse(
            f"GET {url}: no metric {metric} there{unreadable} (llama-server needs --metrics; "
            "check resident.idle.metric)"
        )
    if math.isnan(value):
        raise BadResponse(f"GET {url}: {metric} is NaN: the server does not know")
    return Busy(value > 0, f"{metric} = {value:g}")


async def _run_idle_command(command: list[str], limit: float) -> Busy:
    """Run the configured idle command: idle iff it exits 0 within ``limit`` seconds."""
    shown = shlex.join(command)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as err:
        raise EndpointError(f"cannot run idle command {shown}: {err}") from err
    try:
        async with asyncio.timeout(limit):
            output, _ = await proc.communicate()
    except TimeoutError as err:
        raise EndpointTimeout(
            f"idle command {shown} did not finish within {limit:g}s (killed it)"
        ) from err
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    code = await proc.wait()  # already exited: this only reads the code
    said = output.decode(errors="replace").strip().splitlines()
    tail = f": {snip(said[-1])}" if said else ""
    how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
    return Busy(code != 0, f"{shown} {how}{tail}")


# -- errors ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _mapped(method: str, url: str, timeout: float) -> Iterator[None]:
    """Turn httpx's errors (and an expired asyncio.timeout) into gpuswapd's own."""
    where = f"{method} {url}"
    try:
        yield
    except TimeoutError as err:
        raise EndpointTimeout(f"{where}: no complete answer within {timeout:g}s") from err
    except httpx.ConnectTimeout as err:
        raise EndpointTimeout(f"{where}: could not connect in time (nothing accepts)") from err
    except httpx.TimeoutException as err:
        raise EndpointTimeout(f"{where}: no answer within {timeout:g}s") from err
    except httpx.ConnectError as err:
        raise EndpointUnreachable(
            f"{where}: nothing answers ({err or 'connection failed'}); is the server running?"
        ) from err
    except httpx.NetworkError as err:
        raise EndpointUnreachable(
            f"{where}: the connection broke ({err or type(err).__name__}); did the server die?"
        ) from err
    except (httpx.RemoteProtocolError, httpx.DecodingError) as err:
        raise BadResponse(f"{where}: the server broke off or garbled its answer: {err}") from err
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise EndpointError(f"{where}: {err or type(err).__name__}") from err


async def _raise_status(
    method: str, url: str, response: httpx.Response, hint: str = ""
) -> NoReturn:
    """Fail on a non-200 answer, naming the status and what the server said."""
    raw = b""
    with contextlib.suppress(httpx.HTTPError):
        async for piece in response.aiter_bytes():
            raw += piece
            if len(raw) >= _ERROR_BODY_LIMIT:
                break
    said = message_of(raw.decode(errors="replace"))
    message = f"{method} {url}: HTTP {response.status_code}" + (f": {said}" if said else "")
    cause = httpx.HTTPStatusError(message, request=response.request, response=response)
    raise BadResponse(message + (f"; {hint}" if hint else "")) from cause


def _worth_retrying(err: EndpointError) -> bool:
    """Tell whether a failed completion may pass if tried again (the server is coming up)."""
    if isinstance(err, EndpointUnreachable | EndpointTimeout):
        return True
    cause = err.__cause__
    if isinstance(cause, httpx.HTTPStatusError):
        status = cause.response.status_code
        return status >= 500 or status in (408, 429)
    # Not every TransportError: a URL without http:// will not get better by trying again.
    return isinstance(cause, httpx.RemoteProtocolError | ServerFault)


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadResponse(f"{where}: the answer is not JSON: {snip(raw)}") from err


def _json_object(raw: bytes, where: str) -> dict[str, Any]:
    obj = _json(raw, where)
    if not isinstance(obj, dict):
        raise BadResponse(f"{where}: the answer is not a JSON object: {snip(raw)}")
    return obj


def _reason(err: EndpointError) -> str:
    """Drop the ``METHOD URL: `` that starts an error message."""
    return err.message.split(": ", 1)[-1]
