"""The gateway's errors: each carries the HTTP status and OpenAI error type a client gets.

GpuswapError (gpuswapd.errors)
└── GatewayError                 500 server_error
    ├── BadBody                  400 invalid_request_error  (not JSON, no model)
    ├── BodyTooLarge             413 invalid_request_error  (over gateway.max_body)
    ├── UnknownModel             404 invalid_request_error  (no tenant serves it)
    ├── NoRoute                  404 invalid_request_error  (no such path)
    ├── Refused                  403 permission_error       (a route the front door does not pass: /unload)
    ├── TooManyWaiting           429 rate_limit_error       (gateway.max_waiting wait already)
    ├── ClientTooSlow            408 invalid_request_error  (the body did not arrive in time)
    ├── Unavailable              503 service_unavailable    (the window failed, hold passed, the card is held)
    │   └── BodiesFull           503 service_unavailable    (gateway.max_bodies are held in memory already)
    └── UpstreamFailed           502 upstream_error         (the model server broke off or is unreachable)
"""

from __future__ import annotations

from typing import Any

from gpuswapd.errors import GpuswapError


class GatewayError(GpuswapError):
    """A request the gateway could not serve."""

    code = "gateway"
    status = 500
    kind = "server_error"

    def __init__(self, message: str, retry_after: int | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for a Retry-After header
        self.extra = extra

    def body(self) -> dict[str, Any]:
        """Return the OpenAI-shaped error object."""
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": None,
                          **self.extra}}


class BadBody(GatewayError):
    """The body is not a JSON object with a model."""

    code = "bad_request"
    status = 400
    kind = "invalid_request_error"


class BodyTooLarge(GatewayError):
    """The body is larger than ``gateway.max_body``."""

    code = "body_too_large"
    status = 413
    kind = "invalid_request_error"


class UnknownModel(GatewayError):
    """No tenant serves the model."""

    code = "model_not_found"
    status = 404
    kind = "invalid_request_error"


class NoRoute(GatewayError):
    """No such path."""

    code = "not_found"
    status = 404
    kind = "invalid_request_error"


class Refused(GatewayError):
    """A route the gateway does not pass on (llama-swap's ``/unload``)."""

    code = "refused"
    status = 403
    kind = "permission_error"


class TooManyWaiting(GatewayError):
    """``gateway.max_waiting`` requests wait for a window already."""

    code = "too_many_waiting"
    status = 429
    kind = "rate_limit_error"


class ClientTooSlow(GatewayError):
    """The client did not send its request in time."""

    code = "request_timeout"
    status = 408
    kind = "invalid_request_error"


class Unavailable(GatewayError):
    """The model cannot be served now: its window failed or did not open in time, or the card is held."""

    code = "unavailable"
    status = 503
    kind = "service_unavailable"


class BodiesFull(Unavailable):
    """The request bodies held in memory would go past ``gateway.max_bodies``."""

    code = "bodies_full"


class UpstreamFailed(GatewayError):
    """The model server could not be reached or broke off."""

    code = "upstream_failed"
    status = 502
    kind = "upstream_error"
