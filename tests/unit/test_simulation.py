"""The deterministic simulation in the fast layer: a fixed set of seeds, every saved case, exact replay.

Each saved case in tests/simulate_cases/ is a shrunk history that once broke an invariant; it
must pass now. A case is data, not a seed: it replays the same whatever the generator draws.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

# The simulation runs the real daemon, which imports the D-Bus adapter: a build without PyGObject
# (makepkg's check() on a bare system Python) cannot run it.
pytest.importorskip("gpuswapd.daemon", exc_type=ImportError)

from tests.simulate import draw
from tests.simulation.history import Setup
from tests.simulation.runner import play

CASES = sorted((Path(__file__).parents[1] / "simulate_cases").glob("*.json"))
EVENTS = 120
GROUPS = 4
SEEDS_PER_GROUP = 6


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_a_saved_case_passes(path: Path) -> None:
    case = json.loads(path.read_text())
    outcome = play(Setup.from_dict(case["setup"]), case["events"])
    assert not outcome.violations, f"{case['bug']}\n" + "\n".join(map(str, outcome.violations))


@pytest.mark.parametrize("group", range(GROUPS))
def test_the_fixed_seeds_keep_every_invariant(group: int) -> None:
    failures = []
    for seed in range(group * SEEDS_PER_GROUP, (group + 1) * SEEDS_PER_GROUP):
        setup, events = draw(seed, EVENTS)
        outcome = play(setup, events)
        failures += [f"seed {seed}: {v}" for v in outcome.violations]
        assert outcome.windows > 0, f"seed {seed} opened no window: the history did nothing"
    assert not failures, "\n".join(failures)


def test_a_seed_replays_exactly() -> None:
    setup, events = draw(7, 60)
    first = play(setup, events, trace=True)
    second = play(setup, events, trace=True)
    assert len(first.trace) > 50
    digest = [hashlib.sha256("\n".join(o.trace).encode()).hexdigest() for o in (first, second)]
    assert digest[0] == digest[1], "the same seed played twice did not do the same"
