"""What the benchmarks share: their command line, alternating cycles, order statistics, tables, the results file.

Every benchmark runs its variants alternately within one run (A B A B ..., ``--cycles`` of them,
10 by default), so that drift of the machine (a neighbour's load, a warming page cache) falls on
every variant alike, and compares them cycle by cycle: a ratio or a difference is computed for
each cycle's pair, and its spread is reported, never a ratio of two medians. Each figure is
reported with its n, median, p10-p90 and min-max.
"""

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
CYCLES = 10
T = TypeVar("T")
SPREAD_HEADER = ("", "n", "median", "p10", "p90", "min", "max")


def parser(module: str, doc: str | None, cycles_of: str) -> argparse.ArgumentParser:
    """The command line of ``python -m tests.benchmarks.MODULE``, with its ``--cycles``."""
    p = argparse.ArgumentParser(prog=f"python -m tests.benchmarks.{module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=_at_least_one, default=CYCLES,
                   help=f"cycles, each running every variant once, in turn: {cycles_of} (default {CYCLES})")
    return p


def add_world_options(p: argparse.ArgumentParser) -> None:
    """Add ``--lag`` and ``--boot-delay``: the simulator's constants a window waits for."""
    p.add_argument("--lag", type=_seconds, default=None, metavar="SECONDS",
                   help="the simulated card's VRAM release lag (default: the test world's, 0.5)")
    p.add_argument("--boot-delay", type=_seconds, default=None, metavar="SECONDS",
                   help="the simulated engine's boot delay, ENGINE_BOOT_DELAY (default: the test world's, 1.0)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 600:
        raise argparse.ArgumentTypeError("must be between 0 and 600 seconds")
    return value


def alternate(cycles: int, variants: Sequence[tuple[str, Callable[[], T]]],
              before: Callable[[str], None] | None = None) -> dict[str, list[T]]:
    """Run every variant once per cycle, in turn (A B A B ...); ``before(name)`` runs untimed before each."""
    out: dict[str, list[T]] = {name: [] for name, _ in variants}
    for n in range(cycles):
        for name, run in variants:
            if before is not None:
                before(name)
            out[name].append(run())
            print(f"cycle {n + 1}/{cycles}: {name} {_brief(out[name][-1])}", file=sys.stderr, flush=True)
    return out


def _brief(result: Any) -> str:
    if isinstance(result, dict):
        return " ".join(f"{k} {v:.3f}" for k, v in result.items() if isinstance(v, float))
    return str(result)


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


def quantile(values: Sequence[float], q: float) -> float:
    """Return the ``q``-quantile (0..1), linearly interpolated between the closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Return n, median, p10, p90, min and max of ``values``."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "p10": quantile(values, 0.1),
            "p90": quantile(values, 0.9), "min": min(values), "max": max(values)}


def paired(a: Sequence[float], b: Sequence[float], how: Callable[[float, float], float]) -> list[float]:
    """Combine the two variants' results cycle by cycle (``how(a_i, b_i)``)."""
    if len(a) != len(b):
        raise ValueError(f"unpaired cycles: {len(a)} against {len(b)}")
    return [how(x, y) for x, y in zip(a, b, strict=True)]


def spread_row(label: str, s: dict[str, float]) -> tuple[Any, ...]:
    """A table row of ``spread``: n, median, p10, p90, min, max (under SPREAD_HEADER)."""
    if not s.get("n"):
        return label, 0, None, None, None, None, None
    return label, s["n"], s["median"], s["p10"], s["p90"], s["min"], s["max"]


def figure(s: dict[str, float], unit: str = "s", digits: int = 2) -> str:
    """One figure in words: median, with n, p10-p90 and min-max."""
    if not s.get("n"):
        return "no measurement"

    def f(v: float) -> str:
        return f"{v:.{digits}f}"

    return (f"{f(s['median'])}{unit} (n={s['n']}, p10-p90 {f(s['p10'])}-{f(s['p90'])}, "
            f"min-max {f(s['min'])}-{f(s['max'])})")


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


def bounded_by(*lines: str) -> str:
    """The paragraph of a benchmark's --help that names the simulator's constants bounding it."""
    return "What bounds the result (constants of the simulated world, not of gpuswapd):\n" + \
        "".join(f"  - {line}\n" for line in lines)


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` with the machine's description to RESULTS_DIR/NAME-TIMESTAMP.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {"at": time.time(), "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_1m": os.getloadavg()[0]}
    path.write_text(json.dumps({"meta": meta, **data}, indent=2) + "\n")
    return path
