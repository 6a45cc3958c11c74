"""What a model server says it is: llama.cpp's ``GET /props`` and any OpenAI server's ``GET /v1/models``.

llama-server (llama.cpp's tools/server, its README's "GET /props") answers with, among much else::

    {"default_generation_settings": {"n_ctx": 4096, ...}, "total_slots": 2,
     "model_path": "/models/coder.gguf", "model_alias": "strata", ...}

where ``n_ctx`` is each slot's context (``-c`` split over ``-np`` slots). ``/v1/models`` lists
``{"data": [{"id": "strata", ...}, ...]}``. These parsers turn either answer into plain values,
and anything else into ``BadResponse`` naming what is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpuswapd.adapters.streams import snip
from gpuswapd.errors import BadResponse


@dataclass(frozen=True)
class ServerProps:
    """llama-server's context per slot, its slots, its model file and its alias."""

    n_ctx: int
    slots: int
    model_path: str | None
    alias: str | None


def _object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadResponse(f"{where}: the answer is not JSON: {snip(raw)}") from err
    if not isinstance(body, dict):
        raise BadResponse(f"{where}: the answer is not a JSON object: {snip(raw)}")
    return body


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_props(raw: bytes, where: str) -> ServerProps:
    """Read llama-server's ``/props``: ``default_generation_settings.n_ctx``, ``total_slots``, the model."""
    body = _object(raw, where)
    settings = body.get("default_generation_settings")
    n_ctx = _count(settings.get("n_ctx")) if isinstance(settings, dict) else None
    slots = _count(body.get("total_slots"))
    if n_ctx is None or slots is None:
        raise BadResponse(f"{where}: no default_generation_settings.n_ctx and total_slots: is this llama-server's "
                          f"/props? ({snip(raw)}); check resident.props_url, or set resident.server = \"other\"")
    path, alias = body.get("model_path"), body.get("model_alias")
    return ServerProps(n_ctx, slots, path if isinstance(path, str) else None,
                       alias if isinstance(alias, str) and alias else None)


def parse_model_ids(raw: bytes, where: str) -> list[str]:
    """Read the sorted model ids of an OpenAI ``/v1/models`` answer."""
    body = _object(raw, where)
    data = body.get("data")
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise BadResponse(f"{where}: no list of models with ids (\"data\": [{{\"id\": ...}}]): {snip(raw)}")
    return sorted({m["id"] for m in data})
