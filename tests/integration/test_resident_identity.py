"""The resident comes back as it was, on the real world: llama-server's own /props, the ledger, the history.

Each test opts in to the resident fitting itself to the free memory (tests/stack/llama.py ``Fit``,
as llama.cpp's --fit does: 21 GiB at its full context, 1 GiB left free besides, never under
-c 4096) and leaves it as it was: the fixed 21 GiB claim and two slots of 4096.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.integration.conftest import SLEEPY, assert_resident_back, engine_holds, free_port, scrape, value
from tests.stack import llama, units
from tests.stack.config import ENGINE_ENV
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import Probe
from tests.stack.world import RESIDENT_PORT, SIM_PYTHON, Stack

Start = Callable[..., RunningDaemon]
GiB = 1 << 30
FULL = units.RESIDENT_CTX
STRAY = "stray-gpu.service"


def props() -> dict[str, Any]:
    """Read llama-server's /props (strata itself, not through llama-swap)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{RESIDENT_PORT}/props", timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def shape() -> tuple[int, int]:
    """Return the resident's context per slot and its slots, as llama-server says them."""
    p = props()
    return int(p["default_generation_settings"]["n_ctx"]), int(p["total_slots"])


@pytest.fixture
def fitting(world: Stack) -> Iterator[Stack]:
    """The world's resident fits itself to the free memory from its next start; as it was after the test."""
    llama.enable_fit(world.paths.control)
    yield world
    llama.disable_fit(world.paths.control)
    world.remove_dropins("strata.service")
    world.manager("StopUnit", "ss", STRAY, "replace", check=False)
    if shape() != (FULL, units.RESIDENT_SLOTS) or props().get("model_alias") != "strata":
        world.restart_resident()


def baseline(daemon: RunningDaemon, timeout: float = 30) -> dict[str, Any]:
    """Wait until gpuswapd has recorded the resident's baseline (at its start); return it."""
    deadline = time.monotonic() + timeout
    while (found := daemon.status()["resident"]["baseline"]) is None:
        assert time.monotonic() < deadline, f"no baseline recorded:\n{daemon.tail()}"
        time.sleep(0.1)
    return dict(found)


def cycle(daemon: RunningDaemon, during: Callable[[], None] | None = None) -> dict[str, Any]:
    """Open a window, do ``during`` while it is READY, close it; return its history record."""
    out = daemon.ctl("acquire", "--for", "5m")
    assert out.returncode == 0, out.stderr
    if during is not None:
        during()
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE", timeout=120)
    window: dict[str, Any] = daemon.ctl_json("history")["windows"][-1]
    return window


def start_stray(world: Stack, size: str = "3GiB") -> None:
    """Start a process of another unit that holds VRAM (a user's job nobody told gpuswapd of)."""
    p = world.paths
    world.install_unit(STRAY, f"[Unit]\nDescription=a stray GPU job\nDefaultDependencies=no\n[Service]\n"
                              f"ExecStart={SIM_PYTHON} {p.sim}/gpu_hold.py --dir {p.gpu} --name stray --bytes {size} "
                              "-- sleep infinity\n")
    world.manager("StartUnit", "ss", STRAY, "replace")
    deadline = time.monotonic() + 10
    while not any(h["name"] == "stray" for h in world.ledger()["holders"]):
        assert time.monotonic() < deadline, "the stray process took no memory"
        time.sleep(0.05)


def test_a_parked_residual_beside_a_low_resident_needs_is_found_and_repaired(
        fitting: Stack, gpuswapd: Start, probe: Probe) -> None:
    # resident_needs 19 GiB for a resident that holds 21 and needs 22 free (its 1 GiB --fit margin);
    # the engine keeps 2.5 GiB asleep: 21.5 free passes the 21 GiB learned when the window opened.
    daemon = gpuswapd(gpu={"resident_needs": "19GiB"}, window__park={"mode": "sleep"},
                      window__container={"env": {**SLEEPY, "ENGINE_SLEEP_RESIDUAL_1": "2.5GiB"}})
    assert (baseline(daemon)["n_ctx"], baseline(daemon)["slots"]) == (FULL, 2)
    window = cycle(daemon)

    changed = window["resident_changed"]
    assert changed is not None and changed["repaired"] is True
    assert changed["was"]["n_ctx"] == FULL and changed["now"]["n_ctx"] < FULL  # it first came back smaller
    assert changed["after"]["n_ctx"] == FULL
    assert window["restored"] == "as_it_was" and window["outcome"] == "closed"
    assert shape() == (FULL, 2)  # llama-server itself says so
    assert engine_holds(probe.stack) == 0 and daemon.status()["parked"] is None
    assert_resident_back(probe)  # no container, the timers back, no out-of-memory
    [warned] = daemon.logged("resident_footprint_larger")
    # Learned while the resident still holds it: as PAUSING_TIMERS ends, before STOPPING_RESIDENT's
    # write (which records it) and before any unit stops.
    assert warned["phase"] == "PAUSING_TIMERS" and warned["window_id"] == window["id"]
    stopped = [e for e in daemon.logged("units_stopped") if e["window_id"] == window["id"]]  # the repair's too
    assert stopped and warned["timestamp"] < stopped[0]["timestamp"]
    assert (warned["footprint"], warned["resident_needs"]) == ("21.0 GiB", "19.0 GiB")
    assert daemon.status()["resident"]["needs"] == "21.0 GiB"
    assert daemon.logged("engine_parked")  # it had been parked: the repair removed it


def test_a_stray_process_across_the_close_ends_restored_smaller(fitting: Stack, gpuswapd: Start,
                                                                  probe: Probe) -> None:
    port = free_port()
    daemon = gpuswapd(gpu={"release_timeout": "3s"}, metrics={"listen": f"127.0.0.1:{port}"},
                      window__container={"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": "0.4"}})
    baseline(daemon)
    assert value(scrape(port), "gpuswapd_resident_degraded") == 0
    window = cycle(daemon, lambda: start_stray(fitting))

    assert window["restored"] == "smaller" and window["outcome"] == "closed" and window["degraded"] is None
    n_ctx, slots = shape()
    assert n_ctx < FULL and slots == 2  # it serves, smaller, beside the stray's 3 GiB
    changed = window["resident_changed"]
    assert (changed["was"]["n_ctx"], changed["now"]["n_ctx"], changed["repaired"]) == (FULL, n_ctx, False)
    assert [h["unit"] for h in changed["holders"]] == [STRAY]
    [warning] = daemon.logged("resident_restored_smaller")
    assert f"3.0 GiB by pid {changed['holders'][0]['pid']} ({STRAY})" in warning["error"]
    assert "raise gpu.resident_needs" in warning["error"] and f"n_ctx {n_ctx} (was {FULL})" in warning["error"]
    assert value(scrape(port), "gpuswapd_resident_degraded") == 1
    assert daemon.status()["resident"]["changed"]["window"] == window["id"]
    assert "RESIDENT SMALLER" in daemon.ctl("status").stdout
    assert "restored, smaller" in daemon.ctl("history").stdout
    assert_resident_back(probe)  # the units and timers are back: nothing is stuck


def test_a_resident_that_is_not_llama_cpp_is_compared_by_its_model_ids_only(
        fitting: Stack, gpuswapd: Start, probe: Probe) -> None:
    # The verify goes to llama-server itself, whose /v1/models lists its alias.
    daemon = gpuswapd(gpu={"release_timeout": "3s"},
                      resident={"server": "other", "props_url": None},
                      resident__verify={"url": f"http://127.0.0.1:{RESIDENT_PORT}/v1/chat/completions"},
                      window__container={"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": "0.4"}})
    base = baseline(daemon)
    assert (base["n_ctx"], base["slots"], base["models"]) == (None, None, ["strata"])

    # A smaller context is not what it is compared by.
    window = cycle(daemon, lambda: start_stray(fitting))
    assert window["restored"] == "as_it_was" and window["resident_changed"] is None
    assert shape()[0] < FULL
    fitting.manager("StopUnit", "ss", STRAY, "replace")

    # Its operator serving another alias (a drop-in changes ExecStart=) is the operator's change:
    # the baseline follows it, by its model ids, and nothing is "repaired".
    spec = fitting._spec()
    dropin = "[Service]\nExecStart=\n" + units.resident_exec(spec, alias="strata-lite")
    window = cycle(daemon, lambda: fitting.install_unit("strata.service", None, {"alias.conf": dropin}))
    assert window["restored"] == "as_it_was" and window["resident_changed"] is None
    assert baseline(daemon)["models"] == ["strata-lite"]
    assert props()["model_alias"] == "strata-lite"
    assert_resident_back(probe)
