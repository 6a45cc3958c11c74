"""Structured logs (structlog): JSON lines for the journal, readable lines on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(level: str = "info", json: bool | None = None, cache: bool = True) -> None:
    """Configure structlog: JSON unless stderr is a terminal (``cache=False``: it may be reconfigured)."""
    as_json = not sys.stderr.isatty() if json is None else json
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=cache,
    )


log = structlog.get_logger("gpuswapd")
