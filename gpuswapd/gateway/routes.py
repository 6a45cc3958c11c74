"""Which requests the gateway routes by ``model``, how it finds the model, and the shape its errors take.

What llama-swap routes by ``model`` is routed by ``model`` (a POST, the model in the JSON body or,
for audio and images, in a multipart form's ``model`` field):

    /v1/chat/completions  /v1/completions  /v1/embeddings     OpenAI
    /v1/responses                                             OpenAI's Responses API (vLLM serves it)
    /v1/messages  /v1/messages/count_tokens                   Anthropic's Messages API (llama.cpp, vLLM)
    /infill  /completion                                      llama.cpp's server (editors' fill-in-the-middle)
    /v1/rerank  /v1/reranking  /rerank  /reranking            rerankers
    /v1/audio/...  /v1/images/...                             multipart forms, or JSON

``/upstream/{model}/...`` goes to that model's tenant: the resident's to llama-swap unchanged (its
own ``/upstream/`` route), an engine's as ``/...`` to the engine. The gateway keeps ``/v1/models``,
``/health`` and ``/metrics`` (llama-swap's stay reachable as ``/upstream/{model}/health`` and the
like); ``/unload`` is refused (llama-swap would stop the resident behind gpuswapd's back). Every
other path and method, ``OPTIONS`` included, goes to llama-swap unchanged, query string and all.

The resident's work, which holds gpuswapd's drain: every request routed by model to the resident,
and ``/upstream/{model}/...`` of the resident's. The rest passed through (``/running``, ``/logs``,
``/api/events``, ``/ui``, ``OPTIONS``, ...) waits for the resident like its work does but never
holds a drain: a stream that never ends (``/api/events``, ``/logs/stream``) would hold it for ever.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gpuswapd.gateway.errors import BadBody, GatewayError

MODEL_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens", "/infill", "/completion",
    "/v1/rerank", "/v1/reranking", "/rerank", "/reranking",
})
MODEL_PREFIXES = ("/v1/audio/", "/v1/images/")
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
UPSTREAM_PREFIX = "/upstream/"
REFUSED = frozenset({"/unload"})
SHOWN = 64  # at most this much of a client's model name is said back
# Anthropic's error types, by the gateway's HTTP status (docs.anthropic.com, "Errors").
ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error"}


@dataclass(frozen=True)
class Asked:
    """What a request routed by model asks: the model, and whether the answer streams."""

    model: str
    stream: bool


def routed_by_model(method: str, path: str) -> bool:
    """Tell whether ``method path`` is a request the gateway routes by its ``model``."""
    return method == "POST" and (path in MODEL_ROUTES or path.startswith(MODEL_PREFIXES))


def anthropic(path: str) -> bool:
    """Tell whether the route speaks Anthropic's Messages API (its errors take Anthropic's shape)."""
    return path in ANTHROPIC_ROUTES or (path.startswith(UPSTREAM_PREFIX) and path.endswith(tuple(ANTHROPIC_ROUTES)))


def shown(name: str) -> str:
    """Return ``name`` as the gateway says it back: a short prefix, marked when cut."""
    return name if len(name) <= SHOWN else name[:SHOWN] + f"... ({len(name)} characters)"


def asked(raw: bytes, content_type: bytes) -> Asked:
    """Find the model (and ``stream``) in a JSON body or a multipart form; a body without one is BadBody."""
    if content_type.split(b";")[0].strip().lower() == b"multipart/form-data":
        return _form(raw, content_type)
    return _json(raw)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(raw: bytes) -> Asked:
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw[:4]:  # json.loads would take UTF-16 and -32
        raise BadBody("the body is not UTF-8 JSON (UTF-16 or UTF-32?): send UTF-8")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        said = " (NaN and Infinity are not JSON)" if "is not JSON" in str(err) else ""
        raise BadBody(f"the body is not JSON{said}: send a JSON object with \"model\"", param=None) from None
    if not isinstance(body, dict):
        raise BadBody("the body must be a JSON object with \"model\"")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadBody("the body names no \"model\": GET /v1/models lists them", param="model")
    return Asked(model, body.get("stream") is True)


def _form(raw: bytes, content_type: bytes) -> Asked:
    boundary = b""
    for param in content_type.split(b";")[1:]:
        key, _, value = param.strip().partition(b"=")
        if key.strip().lower() == b"boundary":
            boundary = value.strip().strip(b'"')
    if not boundary:
        raise BadBody("the multipart form has no boundary in its Content-Type")
    # Walked in place: only each part's head and the small fields are copied, never the files.
    fields: dict[str, bytes] = {}
    delimiter = b"\r\n--" + boundary
    at = 0 if raw.startswith(delimiter[2:]) else raw.find(delimiter)
    while at != -1:
        start = raw.find(b"\r\n", at + 2)  # the end of the delimiter line
        end_head = raw.find(b"\r\n\r\n", start) if start != -1 else -1
        if end_head == -1:
            break
        following = raw.find(delimiter, end_head)
        name = _field_name(raw[start:end_head])
        value_end = following if following != -1 else len(raw)
        if name in ("model", "stream") and value_end - end_head <= 4 + 1024:  # a field, not a file
            fields[name] = raw[end_head + 4:value_end]
        at = following
    model = fields.get("model", b"").decode(errors="replace").strip()
    if not model:
        raise BadBody("the multipart form has no \"model\" field: GET /v1/models lists them", param="model")
    return Asked(model, fields.get("stream", b"").strip().lower() == b"true")


def _field_name(head: bytes) -> str | None:
    """Return the ``name`` of a form part whose head is ``head`` (None for a file or no name)."""
    for line in head.split(b"\r\n"):
        kind, _, params = line.partition(b":")
        if kind.strip().lower() != b"content-disposition":
            continue
        found = None
        for item in params.split(b";")[1:]:
            key, _, value = item.strip().partition(b"=")
            if key.strip().lower() == b"filename":
                return None
            if key.strip().lower() == b"name":
                found = value.strip().strip(b'"').decode(errors="replace")
        return found
    return None


def error_body(err: GatewayError, anthropic_shape: bool) -> dict[str, Any]:
    """Return the error as the client's route speaks it: OpenAI's error object or Anthropic's."""
    if not anthropic_shape:
        return err.body()
    kind = ANTHROPIC_KINDS.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def sse_error(err: GatewayError, anthropic_shape: bool) -> bytes:
    """Return the SSE event that ends a stream with ``err``."""
    data = json.dumps(error_body(err, anthropic_shape)).encode()
    return (b"event: error\n" if anthropic_shape else b"") + b"data: " + data + b"\n\n"


def retry_after(err: GatewayError, default: int) -> int | None:
    """Return the Retry-After seconds for ``err``: every 429 and 503 carries one."""
    if err.retry_after is not None:
        return max(0, math.ceil(err.retry_after))
    return default if err.status in (429, 503) else None
