"""Fixtures shared by the whole suite: the test world and a gpuswapd running against it."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.stack.cards import add_second_card
from tests.stack.config import ENGINE_ENV, stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import Probe
from tests.stack.slurm import Slurm
from tests.stack.slurm import start as start_slurm
from tests.stack.users import User, ensure_users, remove
from tests.stack.world import Stack

# The simulated engine's boot in tests: short, since every cold window waits for it (the
# benchmarks and the demo keep the world's 1.0 s, so their figures stay comparable).
TEST_BOOT_DELAY = "0.4"
# How long the simulated card keeps a dead process's memory, in tests: every window waits for it
# twice (the resident's, then the engine's). Real drivers take some 100 ms; the benchmarks and the
# demo keep the world's 0.5 s.
TEST_RELEASE_LAG_S = 0.2
# The lag the tests of switches, preemption and parking run with: what real cards take at worst
# (some 0.1 to 1.5 s; Ollama's scheduler says "typical convergence is 0.5-1.5s"). Each stop then
# costs that long, so few tests ask for it.
HONEST_RELEASE_LAG_S = 1.5

# Property tests check behaviour, not speed: on a loaded 2-core machine (or inside makepkg's
# check()) generating inputs may be slow, and that is no failure.
settings.register_profile("gpuswapd", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("gpuswapd")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep every test of the world on one xdist worker: there is one world per machine.

    With ``-n 2 --dist loadgroup`` (what ``bash tests/run test`` runs), the fast layer, the
    simulators and the packaging checks run on the other worker meanwhile. First among these
    hooks: xdist's own reads the group marker to send the group to one worker, and a marker added
    after it is ignored (the world's tests then spread over both workers, and the second one
    waits for the world the first holds for its whole session).
    """
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("world"))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop an xdist run whose world group did not take (the second worker would wait for the world)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and not item.nodeid.endswith("@world")]
    if lost:
        why = (f"pytest-xdist did not group {len(lost)} tests of the world (e.g. {lost[0]}): this pytest "
               f"({pytest.__version__}) and pytest-xdist do not agree on node ids; install with "
               "-c tests/constraints.txt")
        os.write(2, f"\n{why}\n".encode())  # a worker's own error would only show as its crash
        raise pytest.UsageError(why)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The test world, up for the whole session (``GPUSWAPD_KEEP_STACK=1`` leaves it up after)."""
    world = Stack(release_lag_s=TEST_RELEASE_LAG_S)
    with world.exclusive():
        took = world.up()
        print(f"\ntest world up in {took:.1f}s")
        # The whole session talks to this world: its bus (pydbus's SystemBus() is a per-process
        # singleton that reads this once), its dockerd, its VRAM ledger.
        os.environ.update(world.env())
        yield world
        if os.environ.get("GPUSWAPD_KEEP_STACK") != "1":
            world.down()


@pytest.fixture
def world(stack: Stack) -> Stack:
    """The test world, reset to its baseline before the test."""
    stack.reset()
    return stack


@pytest.fixture
def honest_lag(world: Stack) -> float:
    """The test world whose card frees memory HONEST_RELEASE_LAG_S after it is let go (the next reset undoes it)."""
    world.set_release_lag(HONEST_RELEASE_LAG_S)
    return HONEST_RELEASE_LAG_S


@pytest.fixture
def two_cards(world: Stack) -> Stack:
    """The test world with a second GPU and a resident on it (strata1.service); the next reset removes both."""
    took = add_second_card(world)
    print(f"\nsecond card up in {took:.1f}s")
    return world


@pytest.fixture
def probe(world: Stack) -> Probe:
    """A reader of the world's real state."""
    return Probe(world)


@pytest.fixture
def gpuswapd(world: Stack, request: pytest.FixtureRequest) -> Iterator[Callable[..., RunningDaemon]]:
    """Start gpuswapd with the stack's config (overrides as keyword sections); stopped after the test."""
    started: list[RunningDaemon] = []

    def start(wait: bool = True, env: dict[str, str] | None = None, nofile: int | None = None,
              **sections: dict[str, Any]) -> RunningDaemon:
        name = request.node.name.replace("[", "-").replace("]", "").replace(":", "-")[:36] + f"-{len(started)}"
        if "window__container" not in sections:  # a test that sets its own engine keeps what it set
            sections["window__container"] = {"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": TEST_BOOT_DELAY}}
        config = stack_config(world, name, **sections)
        # A fresh state and log per test: an earlier run of the same test may have left a window there.
        shutil.rmtree(Path(config).parent / "state", ignore_errors=True)
        for marks in Path(config).parent.glob("*.stopped"):  # what an earlier run of gpuswapd stopped
            shutil.rmtree(marks, ignore_errors=True)
        Path(config).with_suffix(".log").unlink(missing_ok=True)
        socket = Path(config).parent / "gpuswapd.sock"
        daemon = RunningDaemon(world, config, socket, env)
        started.append(daemon)
        return daemon.start(wait=wait, nofile=nofile)

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="module")
def slurm_session(stack: Stack) -> Iterator[Slurm]:
    """A single-node Slurm (munged, slurmctld, slurmd), started only for the tests that ask for it.

    Module-scoped: it is stopped when the Slurm tests are done, so the world's own tests (which
    take the world down and check that nothing of it runs) never find it.

    Its Prolog and Epilog reach gpuswapd as instance "default" in ``SLURM_GPUSWAPD_DIR``: a test
    links its daemon's socket there (``slurm_link``).
    """
    run = stack.paths.root / "slurm-gpuswapd"
    run.mkdir(parents=True, exist_ok=True)
    gpu_map = run / "gpus.toml"
    gpu_map.write_text('default_profile = "default"\n[gpus]\n"0" = "default"\n')
    started = time.monotonic()
    slurm = start_slurm(stack.paths.root / "slurm", {"GPUSWAPD_RUNTIME_DIR": str(run),
                                                     "GPUSWAPD_SLURM_MAP": str(gpu_map)})
    print(f"\nslurm up in {time.monotonic() - started:.1f}s")
    yield slurm
    slurm.stop()


@pytest.fixture
def slurm(slurm_session: Slurm, world: Stack) -> Iterator[Slurm]:
    """The session's Slurm with no jobs and its node in service; no jobs left after the test either."""
    slurm_session.cmd("scancel", "--full", "-u", "root", check=False)
    slurm_session.resume()
    yield slurm_session
    slurm_session.cmd("scancel", "--full", "-u", "root", check=False)


@pytest.fixture(scope="session")
def users() -> Iterator[dict[str, User]]:
    """Two members of a socket group and a stranger, made for the session and removed after."""
    made_users, made = ensure_users()
    yield made_users
    remove(made)
