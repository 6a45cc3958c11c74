"""Structured logs (structlog): JSON lines for the journal, readable lines on a terminal."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


def setup_logging(level: str = "info", json: bool | None = None, cache: bool = True,
                  tap: structlog.typing.Processor | None = None) -> None:
    """Configure structlog: JSON unless stderr is a terminal (``cache=False``: it may be reconfigured).

    ``tap`` (the event bus) sees every event at info level and above, whatever ``level`` the log
    keeps: ``gpuswapctl watch``, the hooks and the metrics do not depend on how verbose the log is.
    """
    as_json = not sys.stderr.isatty() if json is None else json
    keep = logging.getLevelName(level.upper())
    processors: list[structlog.typing.Processor] = [structlog.contextvars.merge_contextvars]
    if tap is not None:
        processors += [tap, _below(keep)]
    processors += [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(min(keep, logging.INFO) if tap is not None else keep),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=cache,
    )


def _below(keep: int) -> structlog.typing.Processor:
    """Drop what the log does not keep, once the tap has seen it."""
    levels = logging.getLevelNamesMapping()

    def drop(_logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if levels.get("ERROR" if method == "exception" else method.upper(), logging.INFO) < keep:
            raise structlog.DropEvent
        return event_dict

    return drop


log = structlog.get_logger("gpuswapd")
