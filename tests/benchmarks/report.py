"""What the benchmarks share: their command line, order statistics, a plain table, and the JSON results file."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tests.stack.world import StackError

RESULTS_DIR = Path(os.environ.get("GPUSWAPD_BENCH_DIR", "/var/tmp/gpuswapd-bench"))
T = TypeVar("T")


def parser(module: str, doc: str | None, cycles_of: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``python -m tests.benchmarks.MODULE``; with ``cycles_of``, its ``--cycles``."""
    p = argparse.ArgumentParser(prog=f"python -m tests.benchmarks.{module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if cycles_of is not None:
        p.add_argument("--cycles", type=_at_least_one, default=5, help=f"{cycles_of} (default 5)")
    return p


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def measured(module: str, run: Callable[..., T], *args: Any,
             errors: tuple[type[Exception], ...] = (StackError,)) -> T | None:
    """Run a benchmark; None once it has said on stderr why the world would not let it."""
    try:
        return run(*args)
    except errors as err:
        print(f"{module}: {err}", file=sys.stderr)
        return None


def percentile(values: Sequence[float], p: float) -> float:
    """Return the ``p``-th percentile (nearest rank, as latency percentiles are usually read)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Return n, min, median and max of ``values``."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def spread_row(label: str, s: dict[str, float]) -> tuple[str, float, float, float]:
    """A table row of ``spread``'s min, median and max."""
    return label, s["min"], s["median"], s["max"]


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Format rows under a header, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = [title, _line(list(header), widths), "  ".join("-" * w for w in widths)]
    lines += [_line(row, widths) for row in cells]
    return "\n".join(lines)


def _line(cells: list[str], widths: list[int]) -> str:
    """Join cells, the first left-aligned, the others right-aligned."""
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` with the machine's description to RESULTS_DIR/NAME-TIMESTAMP.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"at": time.time(), "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_1m": os.getloadavg()[0]}
    path.write_text(json.dumps({"meta": meta, **data}, indent=2) + "\n")
    return path
