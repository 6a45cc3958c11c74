"""The deterministic simulation in the fast layer: a fixed set of seeds, every saved case, exact replay.

Each saved case in tests/simulate_cases/ is a shrunk history that once broke an invariant; it
must pass now. A case is data, not a seed: it replays the same whatever the generator draws.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

# The simulation runs the real daemon, which imports the D-Bus adapter: a build without PyGObject
# (makepkg's check() on a bare system Python) cannot run it.
pytest.importorskip("gpuswapd.daemon", exc_type=ImportError)

from gpuswapd import clock
from gpuswapd.window import baseline, closing, identity
from tests.simulate import draw
from tests.simulation.history import Setup
from tests.simulation.loop import SPIN_TURNS, Spin, VirtualClock, VirtualLoop
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


@pytest.mark.parametrize("then", ["idle", "a window"])
def test_the_simulation_catches_a_baseline_that_does_not_follow_its_operator(
        then: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its operator gives the resident a smaller context and restarts it while gpuswapd is idle.

    Planted: neither the changed ExecStart= nor the new InvocationID counts as the operator's.
    Left idle, gpuswapd keeps the old baseline; with a window after, its close repairs the
    resident. Invariant 1 catches both, and neither without the plant.
    """
    case = json.loads((Path(__file__).parents[1] / "simulate_cases" / "planted"
                       / "a-baseline-that-does-not-follow-its-operator.json").read_text())
    events = case["events"] if then == "a window" else case["events"][:1]
    setup = Setup.from_dict(case["setup"])
    assert not play(setup, events).violations
    monkeypatch.setattr(baseline.Identity, "reconfigured", lambda self, was: False)
    monkeypatch.setattr(identity, "last_seen", lambda w: None)
    caught = [v for v in play(setup, events).violations if v.invariant == "1"]
    said = "repaired a resident that came back as its operator configured it" if then == "a window" \
        else "quiet, but gpuswapd's baseline of the resident is n_ctx 4096"
    assert caught and said in caught[0].detail, caught


def test_a_seed_replays_exactly() -> None:
    setup, events = draw(7, 60)
    first = play(setup, events, trace=True)
    second = play(setup, events, trace=True)
    assert len(first.trace) > 50
    digest = [hashlib.sha256("\n".join(o.trace).encode()).hexdigest() for o in (first, second)]
    assert digest[0] == digest[1], "the same seed played twice did not do the same"


def test_the_simulation_catches_a_loop_that_waits_for_time_without_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """A close asks the hung GPU probe again at its deadline's last sliver (seed 10116675's case).

    Planted: the deadline's test back to ``>=``, which a sliver short of it never passes while
    its pause is over at once. The clock stands still on the simulation's; invariant 15 names the
    line, where without it the history grew until the machine's memory ran out.
    """
    case = json.loads((Path(__file__).parents[1] / "simulate_cases"
                       / "a-hung-probe-at-the-release-deadlines-last-sliver-spins-the-close.json").read_text())
    setup = Setup.from_dict(case["setup"])
    assert not play(setup, case["events"]).violations
    monkeypatch.setattr(closing, "naps", SimpleNamespace(due=lambda deadline: clock.monotonic() >= deadline))
    caught = [v for v in play(setup, case["events"]).violations if v.invariant == "15"]
    assert caught and "window/closing.py" in caught[0].detail and "_wait_resident_vram" in caught[0].detail, caught


def test_a_loop_that_turns_without_time_moving_on_is_a_spin() -> None:
    """A task that only yields (``sleep(0)``) and never reads the clock: the loop's turns tell of it."""
    loop = VirtualLoop(VirtualClock())

    async def spin() -> None:
        while True:
            await asyncio.sleep(0)

    loop.create_task(spin())
    with pytest.raises(Spin, match=f"{SPIN_TURNS} turns of the event loop"):
        loop.run_forever()
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.close()
