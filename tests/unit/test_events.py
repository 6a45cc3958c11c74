"""The event bus: one schema for every log event, delivered on the loop in order, whoever logged it."""

from __future__ import annotations

import asyncio
import io
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from gpuswapd.config import HooksConfig
from gpuswapd.events import INTERNAL, KNOWN_EVENTS, LEASE_END_REASONS, PLANNED, EventBus, to_event
from gpuswapd.logs import log, setup_logging
from tests.fakes import FakeWorld, running, settle

PACKAGE = Path(__file__).resolve().parents[2] / "gpuswapd"


PRINTED = io.StringIO()


@pytest.fixture
def bus() -> Iterator[EventBus]:
    """A bus tapping the log, with the log kept at warning (as the fast layer keeps it) and printed to PRINTED."""
    bus = EventBus()
    before = structlog.get_config()
    setup_logging("warning", json=True, cache=False, tap=bus.tap)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=PRINTED))
    PRINTED.seek(0)
    PRINTED.truncate()
    try:
        yield bus
    finally:
        structlog.configure(**before)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_every_info_event_reaches_the_bus_though_the_log_keeps_only_warnings(bus: EventBus) -> None:
    got: list[dict[str, Any]] = []

    async def main() -> None:
        bus.attach(asyncio.get_running_loop())
        bus.subscribe(got.append)
        structlog.contextvars.bind_contextvars(window_id="w1", phase="BOOTING")
        try:
            log.debug("too_fine")
            log.info("engine_started", container="hyperqwen", path=Path("/x"), error=ValueError("no"))
            log.warning("engine_exited", reason="gone")
        finally:
            structlog.contextvars.unbind_contextvars("window_id", "phase")
        await asyncio.sleep(0)

    run(main())
    assert [e["event"] for e in got] == ["engine_started", "engine_exited"]
    first = got[0]
    assert first["window"] == "w1" and first["phase"] == "BOOTING" and first["level"] == "info"
    assert first["path"] == "/x" and first["error"] == "no"  # JSON-safe
    assert "window_id" not in first
    printed = PRINTED.getvalue()
    assert "engine_exited" in printed and "engine_started" not in printed and "too_fine" not in printed


def test_events_logged_on_other_threads_arrive_on_the_loop_in_order(bus: EventBus) -> None:
    got: list[tuple[int, bool]] = []

    async def main() -> None:
        loop_thread = threading.get_ident()
        bus.attach(asyncio.get_running_loop())
        bus.subscribe(lambda e: got.append((e["n"], threading.get_ident() == loop_thread)))

        def worker() -> None:
            for n in range(200):
                log.info("vram_free", n=n)

        await asyncio.to_thread(worker)
        await asyncio.sleep(0.01)

    run(main())
    assert got == [(n, True) for n in range(200)]


def test_the_context_names_the_window_when_the_log_does_not(bus: EventBus) -> None:
    got: list[dict[str, Any]] = []

    async def main() -> None:
        bus.attach(asyncio.get_running_loop())
        bus.context = lambda: {"window": "w2", "phase": "READY", "stage": "open", "elapsed_s": 4.2}
        bus.subscribe(got.append)
        log.info("lease_granted", lease="a", holder="job")
        await asyncio.sleep(0)

    run(main())
    assert {k: got[0][k] for k in ("window", "phase", "stage", "elapsed_s")} == \
        {"window": "w2", "phase": "READY", "stage": "open", "elapsed_s": 4.2}


@pytest.mark.parametrize("name, fields, reason, detail", [
    ("lease_released", {}, "released", None),
    ("lease_released", {"reason": "its client went away"}, "released", "its client went away"),
    ("lease_expired", {}, "expired", None),
    ("lease_ended", {"reason": "unit_gone", "unit": "job.service"}, "unit_gone", None),
    ("lease_ended", {"reason": "closed"}, "closed", None),
    ("lease_ended", {"reason": "the engine failed"}, "closed", "the engine failed"),
    ("lease_preempted", {}, "preempted", None),
])
def test_lease_ends_carry_one_of_the_reasons(name: str, fields: dict[str, Any], reason: str,
                                             detail: str | None) -> None:
    event = to_event(name, "info", fields, {})
    assert event["reason"] == reason and reason in LEASE_END_REASONS
    assert event.get("detail") == detail
    assert "reason" not in to_event("lease_granted", "info", {}, {})


def test_a_failing_subscriber_neither_stops_the_others_nor_loops(bus: EventBus) -> None:
    got: list[str] = []

    def broken(_: dict[str, Any]) -> None:
        raise RuntimeError("bug")

    async def main() -> None:
        bus.attach(asyncio.get_running_loop())
        bus.subscribe(broken)
        bus.subscribe(lambda e: got.append(e["event"]))
        log.info("phase_entered")
        for _ in range(5):
            await asyncio.sleep(0)

    run(main())
    assert got == ["phase_entered"]  # its failure is logged, but not fed back


def test_every_known_event_is_logged_somewhere_and_the_default_hooks_name_known_ones() -> None:
    # The gateway is a process of its own, a client of gpuswapd: its log never reaches gpuswapd's bus.
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if "gateway" not in p.relative_to(PACKAGE).parts)
    logged = set(re.findall(r'log\.(?:info|warning|error|exception|critical|debug)\(\s*"([a-z_]+)"', source))
    assert logged >= KNOWN_EVENTS - PLANNED, sorted(KNOWN_EVENTS - PLANNED - logged)
    assert logged <= KNOWN_EVENTS | INTERNAL, f"logged but unknown to hooks: {sorted(logged - KNOWN_EVENTS - INTERNAL)}"
    assert set(HooksConfig().events) <= KNOWN_EVENTS
    assert not {e for e in KNOWN_EVENTS if e.startswith("hook_")}  # a hook for a hook's failure would loop


def test_a_window_on_fakes_tells_every_phase_and_the_leases_in_order(bus: EventBus) -> None:
    world = FakeWorld()
    got: list[dict[str, Any]] = []

    async def main() -> None:
        bus.attach(asyncio.get_running_loop())
        bus.subscribe(got.append)
        async with running(world.window()) as w:
            lease = await w.acquire("job", 60)
            await w.release(lease.id)
            await settle(w)
        await asyncio.sleep(0)

    run(main())
    [record] = world.store.history_records
    entered = [(e["phase"], e["stage"]) for e in got if e["event"] == "phase_entered"]
    assert entered == [(t["phase"], t["stage"]) for t in record["timings"]]
    assert {e["window"] for e in got if e["event"] == "phase_entered"} == {record["id"]}
    names = [e["event"] for e in got]
    assert names.index("lease_granted") < names.index("lease_released") < names.index("window_finished")
    granted = next(e for e in got if e["event"] == "lease_granted")
    assert granted["waited_s"] >= 0 and granted["holder"] == "job"
    assert next(e for e in got if e["event"] == "lease_released")["reason"] == "released"


def test_without_a_loop_or_subscribers_the_tap_passes_events_through_untouched() -> None:
    bus = EventBus()
    event = {"event": "phase_entered", "x": 1}
    assert bus.tap(None, "info", event) is event and event == {"event": "phase_entered", "x": 1}
