"""The socket protocol: one JSON object per line each way; requests are validated here.

A request is ``{"op": ..., ...}``. The daemon answers with zero or more events
(``{"event": "phase", ...}``) and then exactly one reply: ``{"ok": true, ...}`` or
``{"ok": false, "error": {"code", "message", "phase"?}}``. ``watch`` is answered with events
only (``{"event": "subscribed"}`` first), until the client hangs up.

An ``acquire`` is answered first with ``{"event": "accepted", "token": T, "reclaim_s": G}``: its
reclaim token. Its lease's reply carries the same ``token``. After gpuswapd restarts (its
connection dropped), the client sends its acquire again with ``"reclaim": T``: within ``G``
seconds of the restart it gets its lease back (a lease bound to its connection is kept that long
for it), or its place in the queue (the time it had waited). A token is a secret of its client:
the state document keeps only its hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from gpuswapd.errors import GpuswapError, RequestError
from gpuswapd.timespan import SpanError, parse_span

# A JSON value, as the socket, the status document, the events and the hooks carry it: what is
# built to be sent, and only sent, is typed so (a value read by other modules is a dataclass).
Json: TypeAlias = "bool | int | float | str | Sequence[Json] | Mapping[str, Json] | None"
JsonObject: TypeAlias = "dict[str, Json]"

MAX_LINE = 64 * 1024
MAX_SPAN_S = 10 * 365 * 86400.0
MAX_NESTING = 32
MAX_PRIORITY = 1000
_PROFILE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
OPS = ("acquire", "release", "renew", "status", "plan", "history", "park", "watch")
_FIELDS: dict[str, set[str]] = {
    "acquire": {"for", "holder", "wait", "timeout", "profile", "priority", "hold", "bind", "reclaim"},
    "release": {"lease", "holder"},
    "renew": {"lease", "holder", "for"},
    "status": set(),
    "plan": {"profile"},
    "history": {"limit"},
    "park": {"remove"},
    "watch": set(),
}


@dataclass(frozen=True)
class Request:
    """A validated request."""

    op: str
    duration: float | None = None
    holder: str | None = None
    lease: str | None = None
    wait: bool = True
    timeout: float | None = None
    limit: int = 20
    remove: bool = False
    profile: str = "default"
    priority: int = 0
    hold: bool = False  # keep the connection for the lease's events (preempting, preempted)
    bind: bool = False  # "bind": "connection": the lease ends when its acquire connection does (implies hold)
    reclaim: str | None = None  # the token of an acquire made to a gpuswapd before its restart


def _span(value: Any, key: str, infinite: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RequestError(f"{key!r} must be a time span such as \"15m\" or a number of seconds")
    try:
        seconds = parse_span(value) if isinstance(value, str) else float(value)
    except SpanError as err:
        raise RequestError(f"{key!r}: {err}") from None
    except OverflowError:  # an integer of hundreds of digits
        seconds = math.inf
    if infinite and value == "infinity":
        return seconds  # a lease bound to something outside (a Slurm job); the server lets only root have it
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_SPAN_S:
        raise RequestError(f"{key!r} must be a positive time span of at most 10 years, got {value!r}")
    return seconds


def _text(value: Any, key: str, limit: int = 256) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise RequestError(f"{key!r} must be a non-empty printable string of at most {limit} characters")
    return value


def parse_request(line: bytes) -> Request:
    """Decode and validate one request line."""
    if line.count(b"[") + line.count(b"{") > MAX_NESTING and _depth(line) > MAX_NESTING:
        raise RequestError(f"request is nested deeper than {MAX_NESTING} levels")
    try:
        data = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("request is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise RequestError(f"request is not JSON: {err.msg} at column {err.colno}") from None
    except RecursionError:
        raise RequestError(f"request is nested deeper than {MAX_NESTING} levels") from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise RequestError(f"request has a value gpuswapd will not read: {err}") from None
    if not isinstance(data, dict):
        raise RequestError("request must be a JSON object such as {\"op\": \"status\"}")
    op = data.get("op")
    if not isinstance(op, str) or op not in _FIELDS:
        raise RequestError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    unknown = set(data) - _FIELDS[op] - {"op"}
    if unknown:
        raise RequestError(f"unknown field(s) for {op}: {', '.join(sorted(map(str, unknown)))}")
    wait = data.get("wait", True)
    if not isinstance(wait, bool):
        raise RequestError("'wait' must be true or false")
    remove = data.get("remove", False)
    if not isinstance(remove, bool):
        raise RequestError("'remove' must be true or false")
    limit = data.get("limit", 20)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise RequestError("'limit' must be an integer from 1 to 1000")
    if op == "renew" and "for" not in data:
        raise RequestError("renew needs 'for': the new duration from now")
    return Request(
        op=op,
        duration=_span(data["for"], "for", infinite=True) if "for" in data else None,
        holder=_text(data["holder"], "holder") if "holder" in data else None,
        lease=_text(data["lease"], "lease", 64) if "lease" in data else None,
        wait=wait,
        timeout=_span(data["timeout"], "timeout") if "timeout" in data else None,
        limit=limit,
        remove=remove,
        profile=_profile(data["profile"]) if "profile" in data else "default",
        priority=_priority(data.get("priority", 0)),
        hold=_flag(data.get("hold", False), "hold"),
        bind=_bind(data.get("bind")),
        reclaim=_token(data["reclaim"]) if "reclaim" in data else None,
    )


_TOKEN = re.compile(r"^[0-9a-f]{16,128}$")


def _token(value: Any) -> str:
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise RequestError("'reclaim' must be the token of an earlier acquire (the \"token\" of its "
                           "\"accepted\" event: lowercase hex)")
    return value


def token_hash(token: str) -> str:
    """Return what the state document keeps of a reclaim token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def _bind(value: Any) -> bool:
    if value is None:
        return False
    if value != "connection":
        raise RequestError("'bind' must be \"connection\" (the lease ends when this connection does)")
    return True


def _priority(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise RequestError(f"'priority' must be an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}")
    return value


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{key!r} must be true or false")
    return value


def _profile(value: Any) -> str:
    if not isinstance(value, str) or not _PROFILE.match(value):
        raise RequestError("'profile' must be a profile name: lowercase letters, digits and '-' (e.g. \"bare\")")
    return value


def _depth(line: bytes) -> int:
    """Measure how deeply brackets nest, outside strings (a cheap check before decoding)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def encode(message: dict[str, Any]) -> bytes:
    """Encode one message as a line; a number that is not finite is null (JSON has no Infinity)."""
    try:
        return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    except ValueError:
        return json.dumps(finite(message), separators=(",", ":"), allow_nan=False).encode() + b"\n"


def finite(value: Any) -> Any:
    """Replace every number that is not finite (a lease for infinity's span) by None, throughout."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def error_reply(err: GpuswapError) -> dict[str, Any]:
    """Build the reply that carries an error."""
    return {"ok": False, "error": err.to_dict()}
