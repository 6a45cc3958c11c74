"""One gpuswapd per GPU: two instances on two simulated cards, sharing the test world's dockerd.

The world's second card (GPU 1, strata1.service) comes from the ``two_cards`` fixture; the
packaged template units are run in the world's systemd in test_package.py.
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.integration.conftest import free_port, scrape, value
from tests.stack.cards import RESIDENT1, instance_sections
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import Stack

StartInstance = Callable[..., RunningDaemon]


@pytest.fixture
def instance(two_cards: Stack) -> Iterator[StartInstance]:
    """Start gpuswapd --instance NAME (GPU NAME) with its socket and state under a scratch directory."""
    home = two_cards.paths.root / "gpuswapd" / "instances"
    shutil.rmtree(home, ignore_errors=True)
    run, state = home / "run", home / "state"
    run.mkdir(parents=True)
    env = {"GPUSWAPD_RUNTIME_DIR": str(run), "GPUSWAPD_STATE_ROOT": str(state)}
    started: dict[str, RunningDaemon] = {}

    def start(name: str, **sections: dict[str, Any]) -> RunningDaemon:
        if name not in started:
            config = stack_config(two_cards, f"instance-{name}",
                                  **{**instance_sections(two_cards, name, run, state), **sections})
            started[name] = RunningDaemon(two_cards, config, run / f"{name}.sock", env, ["--instance", name])
        return started[name].start()

    yield start
    for daemon in started.values():
        daemon.stop()


def labels(world: Stack, container: str) -> dict[str, str]:
    out = world.docker("inspect", "--format", "{{json .Config.Labels}}", container, check=True).stdout
    found: dict[str, str] = json.loads(out)
    return found


def holders(world: Stack, card: int) -> list[str]:
    return [h["name"] for h in world.ledger(card)["holders"] if h["dead_at"] is None]


def running(probe: Probe) -> set[str]:
    return {c["Names"] for c in probe.containers() if c["State"] == "running"}


def status_all(daemon: RunningDaemon) -> tuple[int, list[dict[str, Any]], str]:
    out = daemon.ctl("status", "--all", "--json")
    return out.returncode, json.loads(out.stdout)["instances"], out.stderr


def test_two_instances_hand_out_two_cards_independently(instance: StartInstance, two_cards: Stack,
                                                        probe: Probe) -> None:
    world = two_cards
    ports = {"0": free_port(), "1": free_port()}
    gpu0, gpu1 = (instance(name, metrics={"listen": f"127.0.0.1:{ports[name]}"}) for name in ("0", "1"))

    # Windows open on both cards at the same time.
    with ThreadPoolExecutor(2) as pool:
        acquires = list(pool.map(lambda d: d[1].ctl("--instance", d[0], "acquire", "--for", "5m", "--holder",
                                                    f"job{d[0]}"), [("0", gpu0), ("1", gpu1)]))
    assert [a.returncode for a in acquires] == [0, 0], [a.stderr for a in acquires]
    windows = [gpu0.status()["window"], gpu1.status()["window"]]
    opened = [w["opened_at"] for w in windows]
    ready = [next(t["started_at"] for t in w["timings"] if t["phase"] == "READY") for w in windows]
    assert max(opened) < min(ready), "one window opened only after the other was ready"
    assert running(probe) == {"hyperqwen", "hyperqwen1"}
    assert labels(world, "hyperqwen")["io.gpuswapd.instance"] == "0"
    assert labels(world, "hyperqwen1")["io.gpuswapd.instance"] == "1"
    assert (holders(world, 0), holders(world, 1)) == (["hyperqwen"], ["hyperqwen1"])
    assert probe.states([*RESIDENT_UNITS, RESIDENT1]) == dict.fromkeys([*RESIDENT_UNITS, RESIDENT1], "inactive")
    # Each pauses its own timers: instance 0 the agents', instance 1 none.
    assert set(probe.states(list(AGENT_TIMERS)).values()) == {"inactive"}

    # Each scrape carries its own instance on every series (gpuswapd@NAME: instance="NAME").
    for name, port in ports.items():
        families = scrape(port)
        assert {s.labels.get("instance") for f in families.values() for s in f.samples} == {name}, name
        assert value(families, "gpuswapd_leases") == 1

    code, found, _ = status_all(gpu0)
    assert code == 0
    assert [(i["instance"], i["phase"], i["gpu_index"], [lease["holder"] for lease in i["leases"]])
            for i in found] == [("0", "READY", 0, ["job0"]), ("1", "READY", 1, ["job1"])]

    # Restarting instance 0 restores its own resident and never touches instance 1's engine,
    # neither at its stop (restore) nor at its start (clean-up of its own orphans).
    assert gpu0.stop() == 0
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")
    assert set(probe.states(list(AGENT_TIMERS)).values()) == {"active"}
    assert running(probe) == {"hyperqwen1"}
    assert holders(world, 0) == ["strata"]
    gpu0 = instance("0")
    assert gpu0.status()["phase"] == "IDLE"
    assert running(probe) == {"hyperqwen1"}
    status1 = gpu1.status()
    assert status1["phase"] == "READY" and [lease["holder"] for lease in status1["window"]["leases"]] == ["job1"]
    assert probe.active_state(RESIDENT1) == "inactive"

    # Instance 1's window closes on its own: its resident comes back on its card.
    release = gpu1.ctl("--instance", "1", "release", "--holder", "job1")
    assert release.returncode == 0, release.stderr
    gpu1.wait_phase("IDLE", timeout=60)
    assert probe.active_state(RESIDENT1) == "active"
    assert probe.containers() == []
    assert (holders(world, 0), holders(world, 1)) == (["strata"], ["strata1"])
    assert world.ooms() == []

    # An instance that does not answer is named, and status --all exits 3.
    gpu1.signal(signal.SIGKILL)
    assert gpu1.proc is not None
    gpu1.proc.wait()
    code, found, err = status_all(gpu0)
    assert code == 3 and "instance 1 did not answer" in err
    assert [(i["instance"], i["ok"]) for i in found] == [("0", True), ("1", False)]

