"""Run gpuswapd's deterministic simulation: random histories of every feature and fault, invariants all along.

    python -m tests.simulate --seeds N [--start K] [--events M]    seeds K .. K+N-1
    python -m tests.simulate --replay S [--trace]                  one seed again, with every event
    python -m tests.simulate --history FILE [--trace]              a saved (shrunk) history

The last line is always ``N histories, V violations``; the exit status is 0 only when V is 0.
Each violation is printed with its seed, the invariant, and the shortest history found that
still breaks it (events are dropped while it keeps failing). ``--save DIR`` keeps each shrunk
history there as a case (tests/simulate_cases/ is replayed by the fast layer). The invariants
are listed in tests/simulation/runner.py.

A replay is exact only under a fixed PYTHONHASHSEED: this module sets it for its worker
processes, and a run without one starts itself again with PYTHONHASHSEED=0.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import resource
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from tests.simulation.history import Setup, draw_apart, draw_events, draw_setup
from tests.simulation.runner import Outcome, Violation, play

CHUNK = 4  # seeds a worker plays per task

CASES = Path(__file__).with_name("simulate_cases")
STALL_S = 600.0  # a seed that runs longer takes its worker down (a history's longest is about 10 s)
WORKER_MEMORY = 2 << 30  # a worker's address space: a history's peak is about 110 MB (20 seeds of 200 events)
# A worker's heap only grows (the allocator keeps what the largest history so far took: 0.2 MB of
# objects outlive 10 histories, yet a worker held 560 MB after 300): a fresh one every 400 seeds.
TASKS_PER_WORKER = 100


def draw(seed: int, events: int, draw_all: bool = False) -> tuple[Setup, list[dict[str, Any]]]:
    """Draw the configuration and history of one seed (``draw_all``: with the draws of AWAITING_FIX)."""
    rng = random.Random(seed)
    setup = draw_setup(rng)
    history = draw_events(rng, setup, events)
    return setup, draw_apart(seed, setup, history, draw_all)


def run_seed(args: tuple[int, ...]) -> tuple[int, list[Violation], float, int, float]:
    """Play one seed (seed, events[, draw_all]); return its violations, virtual and real seconds, windows."""
    seed, events, *rest = args
    setup, history = draw(seed, events, bool(rest and rest[0]))
    started = time.perf_counter()
    outcome = play(setup, history)
    return seed, outcome.violations, outcome.virtual_s, outcome.windows, time.perf_counter() - started


def fails(setup: Setup, events: list[dict[str, Any]], invariant: str) -> bool:
    """Tell whether this history still breaks ``invariant``."""
    return any(v.invariant == invariant for v in play(setup, events).violations)


def shrink(setup: Setup, events: list[dict[str, Any]], invariant: str, budget: int = 400) -> list[dict[str, Any]]:
    """Drop events while the history keeps breaking ``invariant`` (chunks first, then one by one)."""
    tries = 0
    chunk = max(1, len(events) // 2)
    while chunk >= 1 and tries < budget:
        i, progressed = 0, False
        while i < len(events) and tries < budget:
            candidate = events[:i] + events[i + chunk:]
            tries += 1
            if candidate and fails(setup, candidate, invariant):
                events, progressed = candidate, True
            else:
                i += chunk
        if not progressed:
            chunk //= 2
    return events


def case(seed: int | None, setup: Setup, events: list[dict[str, Any]], violation: Violation) -> dict[str, Any]:
    """Describe a failing history as a saved case."""
    return {"seed": seed, "invariant": violation.invariant, "detail": violation.detail,
            "setup": setup.to_dict(), "events": events}


def save(directory: Path, found: dict[str, Any]) -> Path:
    """Keep a shrunk history as a case file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"seed{found['seed']}-invariant{found['invariant']}.json"
    path.write_text(json.dumps(found, indent=1) + "\n")
    return path


def report(seed: int | None, setup: Setup, events: list[dict[str, Any]], violation: Violation,
           save_dir: Path | None, do_shrink: bool) -> None:
    """Print a violation with its shortest history (and keep it, if asked)."""
    short = shrink(setup, events, violation.invariant) if do_shrink else events
    again = next((v for v in play(setup, short).violations if v.invariant == violation.invariant), violation)
    print(f"seed {seed}: {again}")
    print(f"  shortest history ({len(short)} of {len(events)} events), setup {json.dumps(setup.to_dict())}")
    for event in short:
        print(f"    {json.dumps(event, sort_keys=True)}")
    if save_dir is not None:
        print(f"  saved as {save(save_dir, case(seed, setup, short, again))}")


def print_outcome(outcome: Outcome) -> None:
    """Print a traced run."""
    for line in outcome.trace:
        print(line)
    for v in outcome.violations:
        print(f"violation: {v}")


def fixed_hash_seed() -> None:
    """Start this process again under PYTHONHASHSEED=0 unless it runs under that seed already.

    Set iteration order follows the hash seed: the pool's workers run under 0, so a replay must.
    """
    if os.environ.get("PYTHONHASHSEED") == "0":
        return
    env = dict(os.environ, PYTHONHASHSEED="0")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "tests.simulate", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    """Run the simulation as asked."""
    parser = argparse.ArgumentParser(prog="python -m tests.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=0, help="how many seeds to run")
    parser.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--events", type=int, default=200, help="events per history (default 200)")
    parser.add_argument("--replay", type=int, metavar="S", help="replay seed S")
    parser.add_argument("--history", type=Path, metavar="FILE", help="replay a saved history")
    parser.add_argument("--trace", action="store_true", help="print every event, phase change and log line")
    parser.add_argument("--save", type=Path, metavar="DIR", help="keep each shrunk failing history in DIR")
    parser.add_argument("--no-shrink", action="store_true", help="report failing histories whole")
    parser.add_argument("--shrink-for", metavar="INVARIANT",
                        help="with --replay or --history: first shrink the history against this invariant")
    parser.add_argument("--draw-all", action="store_true",
                        help="draw what awaits a fix too (tests/simulation/history.py's AWAITING_FIX)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    args = parser.parse_args(argv)
    if argv is None:
        fixed_hash_seed()
    if args.history is not None or args.replay is not None:
        if args.history is not None:
            saved = json.loads(args.history.read_text())
            setup, events, seed = Setup.from_dict(saved["setup"]), saved["events"], saved.get("seed")
        else:
            seed = args.replay
            setup, events = draw(seed, args.events, args.draw_all)
        if args.shrink_for and not fails(setup, events, args.shrink_for):
            print(f"it does not break invariant {args.shrink_for}: nothing to shrink")
        elif args.shrink_for:
            events = shrink(setup, events, args.shrink_for)
            print(f"shrunk to {len(events)} events:")
            for event in events:
                print(f"    {json.dumps(event, sort_keys=True)}")
            if args.save:
                v = next(v for v in play(setup, events).violations if v.invariant == args.shrink_for)
                print(f"  saved as {save(args.save, case(seed, setup, events, v))}")
        outcome = play(setup, events, trace=args.trace)
        if args.trace:
            print_outcome(outcome)
        for v in outcome.violations:
            print(f"seed {seed}: {v}")
        print(f"1 histories, {len(outcome.violations)} violations")
        return 0 if not outcome.violations else 1
    if args.seeds < 1:
        parser.error("give --seeds N, --replay S or --history FILE")
    seeds = [(seed, args.events, int(args.draw_all)) for seed in range(args.start, args.start + args.seeds)]
    started = time.perf_counter()
    failing: list[tuple[int, list[Violation]]] = []
    virtual = windows = 0.0
    lost: list[int] = []
    if args.jobs > 1 and len(seeds) > 1:
        os.environ["PYTHONHASHSEED"] = "0"  # as a replay runs (fixed_hash_seed)
        results, lost = run_pool(seeds, args.jobs)
        if lost:  # each alone in a worker of its own: only the seeds that take a worker down stay lost
            print(f"a worker process died or ran past its time running seeds {_ranges(lost)}; each runs again alone",
                  flush=True)
            again, lost = run_pool([item for item in seeds if item[0] in set(lost)], 1, chunk=1)
            results += again
    else:
        results = [run_seed(item) for item in seeds]
    for seed, violations, v_s, n_windows, _ in results:
        virtual, windows = virtual + v_s, windows + n_windows
        if violations:
            failing.append((seed, violations))
    took = time.perf_counter() - started
    count = 0
    for seed, violations in sorted(failing):
        setup, events = draw(seed, args.events, args.draw_all)
        for violation in violations:
            count += 1
            if violation.invariant == "memory":  # replayed here it would take this process's memory too
                print(f"seed {seed}: {violation}")
                continue
            report(seed, setup, events, violation, args.save, not args.no_shrink)
    print(f"{len(seeds)} seeds in {took:.1f}s ({len(seeds) / took:.1f} histories/s on {args.jobs} process(es)); "
          f"{virtual / 3600:.1f} virtual hours, {int(windows)} windows")
    if lost:
        print(f"seeds that take a worker process down or run past {STALL_S:g}s (not run; see each with "
              f"--replay S --trace under ulimit -v): {_ranges(lost)}")
    print(f"{len(seeds) - len(lost)} histories, {count} violations")
    return 0 if count == 0 and not lost else 1


def run_chunk(items: list[tuple[int, ...]]) -> list[tuple[int, list[Violation], float, int, float]]:
    """Play a few seeds in a worker process; a seed that runs out of its memory (``WORKER_MEMORY``) is a finding."""
    results = []
    for item in items:
        try:
            results.append(run_seed(item))
        except MemoryError:
            gc.collect()
            results.append((item[0], [Violation("memory", 0.0, f"the history ran out of the worker's "
                                                 f"{WORKER_MEMORY >> 30} GiB (replay it under a cap: ulimit -v)")],
                            0.0, 0, 0.0))
    return results


def _cap_memory() -> None:
    """Cap a worker's address space: a history that grows without bound fails alone, not the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))


def run_pool(seeds: list[tuple[int, ...]], jobs: int, chunk: int = CHUNK) -> tuple[
        list[tuple[int, list[Violation], float, int, float]], list[int]]:
    """Play the seeds on ``jobs`` worker processes; return their results, and the seeds a worker that died left unrun.

    A worker that dies (killed, out of memory, a crash of the interpreter, or killed here when its
    task runs past ``STALL_S`` a seed) breaks its pool: the chunks in flight then are returned as
    not run, and the rest go on in a fresh pool. With
    ``jobs`` and ``chunk`` at 1, what is returned is exactly the seeds that take a worker down.
    """
    results: list[tuple[int, list[Violation], float, int, float]] = []
    lost: list[int] = []
    todo = [seeds[i:i + chunk] for i in range(0, len(seeds), chunk)][::-1]
    while todo:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_cap_memory,
                                 max_tasks_per_child=TASKS_PER_WORKER) as pool:
            running: dict[Future[list[tuple[int, list[Violation], float, int, float]]], list[tuple[int, ...]]] = {}
            since: dict[Future[list[tuple[int, list[Violation], float, int, float]]], float] = {}
            broken = False
            while (todo or running) and not broken:
                while todo and len(running) < jobs:  # no more in flight than workers: a break names few seeds
                    items = todo.pop()
                    future = pool.submit(run_chunk, items)
                    running[future], since[future] = items, time.monotonic()
                first = min(since[f] for f in running)
                done, _ = wait(running, timeout=max(0.0, first + STALL_S * chunk - time.monotonic()),
                               return_when=FIRST_COMPLETED)
                if not done:  # a task ran past its time (a history that never ends): its worker goes
                    for process in list(getattr(pool, "_processes", {}).values()):  # (the pool's own, by PID)
                        process.kill()
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    items = running.pop(future)
                    try:
                        results += future.result()
                    except BrokenProcessPool:
                        lost, broken = lost + [item[0] for item in items], True
            for future, items in running.items():  # the same pool: broken too, or finished before it broke
                try:
                    results += future.result()
                except BrokenProcessPool:
                    lost += [item[0] for item in items]
    return results, sorted(lost)


def _ranges(seeds: list[int]) -> str:
    """Write seeds as ranges: 5-8, 12."""
    parts: list[str] = []
    for seed in sorted(seeds):
        if parts and parts[-1].split("-")[-1] == str(seed - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{seed}"
        else:
            parts.append(str(seed))
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
