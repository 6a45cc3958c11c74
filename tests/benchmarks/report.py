"""What both benchmarks share: order statistics, a plain table, and the JSON results file."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(os.environ.get("GPUSWAPD_BENCH_DIR", "/var/tmp/gpuswapd-bench"))


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
