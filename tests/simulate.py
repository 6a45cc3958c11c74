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
import json
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from tests.simulation.history import Setup, draw_apart, draw_events, draw_setup
from tests.simulation.runner import Outcome, Violation, play

CASES = Path(__file__).with_name("simulate_cases")


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
    if args.jobs > 1 and len(seeds) > 1:
        os.environ["PYTHONHASHSEED"] = "0"  # as a replay runs (fixed_hash_seed)
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.imap_unordered(run_seed, seeds, chunksize=4)
            for seed, violations, v_s, n_windows, _ in results:
                virtual, windows = virtual + v_s, windows + n_windows
                if violations:
                    failing.append((seed, violations))
            # Let the workers exit by themselves: the pool's terminate() at the with's end would
            # leave their semaphores for the resource tracker to warn of.
            pool.close()
            pool.join()
    else:
        for item in seeds:
            seed, violations, v_s, n_windows, _ = run_seed(item)
            virtual, windows = virtual + v_s, windows + n_windows
            if violations:
                failing.append((seed, violations))
    took = time.perf_counter() - started
    count = 0
    for seed, violations in sorted(failing):
        setup, events = draw(seed, args.events, args.draw_all)
        for violation in violations:
            count += 1
            report(seed, setup, events, violation, args.save, not args.no_shrink)
    print(f"{len(seeds)} seeds in {took:.1f}s ({len(seeds) / took:.1f} histories/s on {args.jobs} process(es)); "
          f"{virtual / 3600:.1f} virtual hours, {int(windows)} windows")
    print(f"{len(seeds)} histories, {count} violations")
    return 0 if count == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
