"""How fast the deterministic simulation plays histories: histories per second, and the time for 1,000 of 200 events.

    .venv/bin/python -m tests.benchmarks.simulation_bench [--cycles 10] [--seeds 100] [--events 200]
                                                         [--start 0] [--jobs N] [--baseline REV]

With ``--baseline REV`` the same seeds are played, alternately, by the simulation of commit REV
(checked out once as a git worktree under /var/tmp/gpuswapd-bench/, its workers importing that
tree's gpuswapd and tests) and by this checkout's: cycle n plays seeds S..S+N-1 with REV, then the
same seeds with this code, so the machine's load falls on both alike; the figure to compare is
histories per CPU second of the workers, and the report gives this code's over REV's.

Plays the histories of ``python -m tests.simulate`` (tests/simulate.py's ``run_seed``: draw a seed's
setup and history, play it against the real daemon on virtual time with every invariant checked)
in ``--jobs`` worker processes, as ``tests.simulate --jobs`` does, with the same PYTHONHASHSEED.
Each cycle plays the next ``--seeds`` seeds (cycle 1 seeds START .. START+N-1, cycle 2 the N after,
and so on), so the defaults play seeds 0 .. 999: 1,000 histories of 200 events. There is one
variant, so nothing alternates: the cycles are repeats over fresh seeds, and their spread is the
spread of the histories drawn and of the machine. The worker pool is started and warmed before
the first cycle (its start-up, the workers' imports, is printed apart), so a cycle's time is the
playing of its histories alone, from the first seed handed out to the last result back.

Per cycle: its seconds, histories per second (wall), histories per CPU second of the workers
(what the machine's other load does not move), events per second, and the virtual hours and
windows its histories simulated. Over the run: the time for every history (the cycles' seconds
added), one history's own time and CPU time as its worker measured them (the spread over every history), the
virtual time simulated against real time, and any invariant violated (seed and invariant; the
simulation's own command, ``python -m tests.simulate --replay SEED``, shrinks and explains it).

What bounds the result (not gpuswapd's speed in service, nor the simulated world's constants as lags):
  - it is pure CPU: the world runs on a virtual clock (no sleeps, no I/O, no real systemd or
    Docker), so the rate is the cores' (2 here, shared with other work: --jobs 2 by default) over
    the Python that the daemon, the simulated world and the invariant checks run;
  - the history length sets it: --events (200 by default) events, drawn about 12 virtual seconds
    apart, and the simulation runs on until the world is quiet, checking the invariants every
    virtual second (CHECK_EVERY_S), so a longer history costs more per event as well as in all;
  - what each seed draws sets how much happens between the events: the VRAM release lags
    (exit_lag and sleep_lag, 0-3 s), the engine's boot (2, 8 or 30 s), linger, grace, the leases'
    lengths and the faults; the cycles' spread is mostly that, not the machine.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.benchmarks.report import (
    SPREAD_HEADER,
    alternate,
    figure,
    parser,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.simulate import run_seed

CHUNKSIZE = 4  # as tests.simulate hands out its seeds
BASELINES = Path("/var/tmp/gpuswapd-bench")
_run_seed: Any = run_seed  # in a baseline's worker: that commit's run_seed


def play(args: tuple[int, int]) -> tuple[Any, ...]:
    """Play one seed with ``run_seed`` in a worker; add the CPU seconds it took there (not a neighbour's)."""
    started = time.process_time()
    out = _run_seed(args)
    return (*out, time.process_time() - started)


def _ready(barrier: Any, tree: str | None = None) -> None:
    """Start a worker: it has imported the simulation (with this module); play a short history, wait for the rest.

    With ``tree`` (a baseline's checkout), the worker forgets this checkout's gpuswapd and tests
    (but this module) and plays with that tree's.
    """
    global _run_seed
    if tree is not None:
        for name in list(sys.modules):
            ours = name.startswith("tests.benchmarks") or name == __name__
            if name.split(".")[0] in ("gpuswapd", "tests") and not ours:
                del sys.modules[name]
        sys.path.insert(0, tree)
        _run_seed = importlib.import_module("tests.simulate").run_seed
    _run_seed((0, 20))
    barrier.wait()


def checkout(rev: str) -> Path:
    """Check commit ``rev`` out once as a detached git worktree under /var/tmp/gpuswapd-bench/."""
    top = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(top), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    tree = BASELINES / f"baseline-{commit[:12]}"
    if not (tree / "tests" / "simulate.py").exists():
        BASELINES.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(top), "worktree", "add", "--detach", "--force", str(tree), commit],
                       check=True, capture_output=True, text=True)
    return tree


@contextmanager
def workers(jobs: int, tree: Path | None = None) -> Iterator[tuple[Any, float]]:
    """A pool of ``jobs`` spawned workers, all started and warmed; yield it with its start-up seconds."""
    os.environ["PYTHONHASHSEED"] = "0"  # as tests.simulate: replays are exact
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(jobs + 1)
    started = time.perf_counter()
    with context.Pool(jobs, initializer=_ready, initargs=(barrier, None if tree is None else str(tree))) as pool:
        barrier.wait(timeout=300)
        yield pool, time.perf_counter() - started


def cycle(pool: Any, jobs: int, seeds: range, events: int) -> dict[str, Any]:
    """Play one cycle's seeds in the pool; return its seconds and what its histories did."""
    # tests.simulate's chunks of 4, smaller when there are too few seeds to give every worker some.
    chunksize = max(1, min(CHUNKSIZE, len(seeds) // (4 * jobs)))
    started = time.perf_counter()
    results = list(pool.imap_unordered(play, [(seed, events) for seed in seeds], chunksize=chunksize))
    took = time.perf_counter() - started
    violations = sorted((seed, v.invariant) for seed, found, *_ in results for v in found)
    cpu = sum(r[5] for r in results)
    return {"seeds": [seeds.start, seeds.stop - 1], "histories": len(results), "seconds": took,
            "histories_per_s": len(results) / took, "events_per_s": len(results) * events / took,
            "virtual_h": sum(r[2] for r in results) / 3600, "windows": sum(r[3] for r in results),
            "history_s": [r[4] for r in results], "history_cpu_s": [r[5] for r in results],
            "cpu_s": cpu, "histories_per_cpu_s": len(results) / cpu, "violations": violations}


def run(cycles: int, seeds: int, events: int, start: int, jobs: int) -> dict[str, Any]:
    """Warm the pool, then play the cycles one after another."""
    with workers(jobs) as (pool, startup):
        ranges = iter(range(start + n * seeds, start + (n + 1) * seeds) for n in range(cycles))
        played = alternate(cycles, [("histories", lambda: cycle(pool, jobs, next(ranges), events))])["histories"]
    return {"seeds_per_cycle": seeds, "events": events, "start": start, "jobs": jobs, "pool_startup_s": startup,
            "cycles": played}


def run_against(rev: str, cycles: int, seeds: int, events: int, start: int, jobs: int) -> dict[str, Any]:
    """Play each cycle's seeds with commit ``rev``'s simulation, then with this one's (A B A B ...)."""
    tree = checkout(rev)
    with workers(jobs, tree) as (old, old_startup), workers(jobs) as (new, startup):
        ranges = [range(start + n * seeds, start + (n + 1) * seeds) for n in range(cycles)]
        turn = {"baseline": iter(ranges), "current": iter(ranges)}
        played = alternate(cycles, [("baseline", lambda: cycle(old, jobs, next(turn["baseline"]), events)),
                                    ("current", lambda: cycle(new, jobs, next(turn["current"]), events))])
    return {"seeds_per_cycle": seeds, "events": events, "start": start, "jobs": jobs, "baseline": rev,
            "baseline_tree": str(tree), "pool_startup_s": startup, "baseline_pool_startup_s": old_startup,
            "cycles": played["current"], "baseline_cycles": played["baseline"]}


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Spread of each per-cycle figure, the totals, and one history's time over every history."""
    c = result["cycles"]
    stats: dict[str, Any] = {key: spread([x[key] for x in c])
                             for key in ("seconds", "histories_per_s", "histories_per_cpu_s", "events_per_s",
                                         "virtual_h", "windows")}
    total_s = sum(x["seconds"] for x in c)
    histories = sum(x["histories"] for x in c)
    virtual_h = sum(x["virtual_h"] for x in c)
    stats["history_s"] = spread([s for x in c for s in x["history_s"]])
    stats["history_cpu_s"] = spread([s for x in c for s in x["history_cpu_s"]])
    stats["total"] = {"histories": histories, "seconds": total_s, "histories_per_s": histories / total_s,
                      "virtual_h": virtual_h, "windows": sum(x["windows"] for x in c),
                      "virtual_per_real": virtual_h * 3600 / total_s, "cpu_s": sum(x["cpu_s"] for x in c)}
    stats["violations"] = [v for x in c for v in x["violations"]]
    return stats


def print_report(result: dict[str, Any], stats: dict[str, Any]) -> None:
    """Print the table and the totals."""
    n, events, cycles = result["seeds_per_cycle"], result["events"], len(result["cycles"])
    rows = [spread_row(f"seconds per cycle of {n} histories", stats["seconds"]),
            spread_row("histories per second", stats["histories_per_s"]),
            spread_row("histories per CPU second of the workers", stats["histories_per_cpu_s"]),
            spread_row("events per second", stats["events_per_s"]),
            spread_row("virtual hours simulated per cycle", stats["virtual_h"]),
            spread_row("windows opened per cycle", stats["windows"]),
            spread_row("one history, its worker's seconds (over every history)", stats["history_s"]),
            spread_row("one history, its worker's CPU seconds (over every history)", stats["history_cpu_s"])]
    print(table(f"\nthe deterministic simulation, {cycles} cycles of {n} histories of {events} events, "
                f"{result['jobs']} worker process(es)", SPREAD_HEADER, rows))
    t = stats["total"]
    print(f"\n{t['histories']} histories of {events} events in {t['seconds']:.1f} s "
          f"({t['histories_per_s']:.1f} histories/s): {t['virtual_h']:.1f} virtual hours "
          f"({t['virtual_per_real']:,.0f}x real time), {t['windows']} windows; the workers' CPU {t['cpu_s']:.1f} s")
    print(f"histories per second, per cycle: {figure(stats['histories_per_s'], '', 1)}")
    print(f"the worker pool's start-up (spawn, imports, one warm-up history each), not counted: "
          f"{result['pool_startup_s']:.2f} s; cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    found = stats["violations"]
    print(f"invariants violated: {len(found)}" + "".join(
        f"\n  seed {seed}: invariant {inv} (python -m tests.simulate --replay {seed} --events {events})"
        for seed, inv in found))


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the simulation benchmark."""
    cli = parser("simulation_bench", __doc__, cycles_of="the next --seeds histories")
    cli.add_argument("--seeds", type=_count, default=100, help="histories per cycle (default 100)")
    cli.add_argument("--events", type=_count, default=200, help="events per history (default 200)")
    cli.add_argument("--start", type=_seed, default=0, help="the first seed (default 0)")
    cli.add_argument("--jobs", type=_count, default=os.cpu_count() or 1,
                     help="worker processes (default: all cores)")
    cli.add_argument("--baseline", metavar="REV",
                     help="play the same seeds alternately with commit REV's simulation (e.g. e04e979)")
    args = cli.parse_args(argv)
    if args.baseline is None:
        result = run(args.cycles, args.seeds, args.events, args.start, args.jobs)
        stats = analyse(result)
        print_report(result, stats)
        print(f"\nresults: {write_results('simulation', {**result, 'stats': stats})}")
        return 0
    result = run_against(args.baseline, args.cycles, args.seeds, args.events, args.start, args.jobs)
    stats = analyse(result)
    old = analyse({**result, "cycles": result["baseline_cycles"]})
    print_report({**result, "cycles": result["baseline_cycles"], "jobs": result["jobs"]}, old)
    print(f"(above: commit {args.baseline}'s simulation; below: this checkout's, on the same seeds)")
    print_report(result, stats)
    ratios = [new["histories_per_cpu_s"] / was["histories_per_cpu_s"]
              for new, was in zip(result["cycles"], result["baseline_cycles"], strict=True)]
    stats["speedup_per_cpu_s"] = spread(ratios)
    print(f"\nhistories per CPU second, this checkout over {args.baseline}, per cycle (same seeds): "
          f"{figure(stats['speedup_per_cpu_s'], 'x', 2)}; over the run: "
          f"{stats['total']['histories'] / stats['total']['cpu_s']:.3f} against "
          f"{old['total']['histories'] / old['total']['cpu_s']:.3f} histories/CPU-s")
    print(f"\nresults: {write_results('simulation', {**result, 'stats': stats, 'baseline_stats': old})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
