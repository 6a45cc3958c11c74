"""The typed values that cross module lines: each reads back what it writes, and older documents."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gpuswapd.errors import ErrorRecord, GpuswapError, WontFit
from gpuswapd.phases import Phase
from gpuswapd.record import (
    BaselineRestore,
    ContainerHandle,
    Finished,
    PreemptedHolder,
    Preemption,
    WindowRecord,
)
from gpuswapd.window.plan import HeldBy, Plan, PlanContainer, PlanVram
from gpuswapd.window.price import Times, boot_took


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Tell whether two documents serialize to the same bytes (key order included)."""
    return json.dumps(a) == json.dumps(b)


def test_a_container_handle_reads_back_what_it_writes_in_the_order_it_was_read() -> None:
    up = ContainerHandle(name="hyperqwen", created=True, image="hyperqwen:latest", window="w1", spec="abc")
    full = {"name": "hyperqwen", "created": True, "image": "hyperqwen:latest", "window": "w1", "spec": "abc",
            "free_before_boot": 24, "pids": [7, 9], "sleep": True, "canary": "2, 3, 5", "residual_bytes": 3,
            "removed": True, "parked": True}
    assert same(up.to_dict(), {"name": "hyperqwen", "created": True, "image": "hyperqwen:latest", "window": "w1",
                               "spec": "abc"})
    assert ContainerHandle.from_dict(up.to_dict()) == up
    assert same(ContainerHandle.from_dict(full).to_dict(), full)
    # A state document's keys are sorted: read back, they stay so; a key set later comes last.
    stored = dict(sorted(full.items()))
    handle = ContainerHandle.from_dict(stored)
    assert same(handle.to_dict(), stored)
    parked = handle.without("sleep", "canary", "removed", "parked")
    assert "sleep" not in parked.to_dict()
    woken = ContainerHandle.from_dict(parked.to_dict())
    assert list(replace(woken, sleep=True, canary="x").to_dict())[-2:] == ["sleep", "canary"]


def test_a_container_handle_of_an_older_or_partial_document_reads() -> None:
    old = {"name": "hyperqwen", "created": False, "image": "hyperqwen:latest"}  # a baseline restore's, or 0.1's
    assert same(ContainerHandle.from_dict(old).to_dict(), old)
    odd = ContainerHandle.from_dict({"name": "x", "pids": [1, True, "2", 3], "created": "yes", "sleep": 1})
    assert odd.pids == (1, 3) and odd.created is None and odd.sleep is None and odd.pid_list == [1, 3]
    assert ContainerHandle.from_dict({}).to_dict() == {}
    # learn_canary writes the canary beside sleep, null or not.
    assert ContainerHandle(name="x", sleep=False).to_dict() == {"name": "x", "sleep": False, "canary": None}


def test_a_preemption_reads_back_what_it_writes_and_an_older_one() -> None:
    noticed = Preemption(by="urgent", profile="bare", priority=5, at=1.0, grace_s=2.0, deadline=3.0,
                         holders=(PreemptedHolder("l1", "train", 0, "train.service"),))
    assert same(noticed.to_dict(), {
        "by": "urgent", "profile": "bare", "priority": 5, "at": 1.0, "grace_s": 2.0, "deadline": 3.0,
        "revoked_at": None, "abandoned_at": None,
        "holders": [{"lease": "l1", "holder": "train", "priority": 0, "unit": "train.service"}]})
    assert not noticed.ended and Preemption.from_dict(noticed.to_dict()) == noticed
    revoked = Preemption.from_dict({**noticed.to_dict(), "revoked_at": 4.0, "stopped_units": ["train.service"],
                                    "stops_pending": []})
    assert revoked.ended and revoked.stopped_units == ("train.service",) and revoked.stops_pending == ()
    assert same(revoked.to_dict(), {**noticed.to_dict(), "revoked_at": 4.0, "stopped_units": ["train.service"],
                                    "stops_pending": []})
    stored = json.loads(json.dumps(revoked.to_dict(), sort_keys=True))
    assert same(Preemption.from_dict(stored).to_dict(), stored)
    old = {"by": "urgent", "profile": "bare", "priority": 5, "at": 1.0, "grace_s": 2.0, "deadline": 3.0}
    partial = Preemption.from_dict(old)  # no revoked_at, abandoned_at, holders: pending
    assert not partial.ended and partial.holders == () and partial.deadline == 3.0


def test_an_error_record_is_what_the_error_serializes_to() -> None:
    err = WontFit("no room", phase="WAITING_VRAM")
    record = ErrorRecord.of(err)
    assert same(record.to_dict(), err.to_dict())
    assert ErrorRecord.from_dict(record.to_dict()) == record
    again = record.error()
    assert isinstance(again, WontFit) and again.message == "no room" and again.phase == "WAITING_VRAM"
    old = ErrorRecord.from_dict({"message": "it broke"})  # no code, no phase
    assert old.to_dict() == {"code": "error", "message": "it broke"} and type(old.error()) is GpuswapError


def test_a_baseline_restore_reads_back_and_an_empty_one_stays_empty() -> None:
    restore = BaselineRestore(reason="no state", at=5.0, cause="state_unreadable")
    assert same(restore.to_dict(), {"reason": "no state", "at": 5.0, "cause": "state_unreadable"})
    assert BaselineRestore.from_dict(restore.to_dict()) == restore
    stored = dict(sorted(restore.to_dict().items()))
    assert same(BaselineRestore.from_dict(stored).to_dict(), stored)
    assert BaselineRestore.from_dict({}).to_dict() == {}
    assert BaselineRestore.from_dict({"reason": "old"}).to_dict() == {"reason": "old"}


def test_a_window_record_with_every_typed_part_reads_back_byte_for_byte() -> None:
    rec = WindowRecord.new(now=100.0)
    rec.enter(Phase.DRAINING, now=100.0)
    rec.container = ContainerHandle(name="hyperqwen", created=True, pids=(4,), sleep=True, canary="ok")
    rec.preempted = Preemption(by="u", profile="bare", priority=1, at=1.0, grace_s=0.0, deadline=1.0)
    rec.baseline = BaselineRestore(reason="r", at=2.0, cause="found_down")
    rec.fail(WontFit("no room"))
    document = json.loads(json.dumps(rec.to_dict()))
    back = WindowRecord.from_dict(document)
    assert back.container == rec.container and back.preempted == rec.preempted and back.baseline == rec.baseline
    assert back.error == ErrorRecord("wont_fit", "no room", "DRAINING")
    assert json.dumps(back.to_dict()) == json.dumps(rec.to_dict())
    assert json.dumps(rec.finished().to_dict()) == json.dumps(rec.to_dict())  # the history line, unchanged


def _line(**extra: Any) -> dict[str, Any]:
    return {"id": "w1", "profile": "eval", "start": "cold", "opened_at": 0.0, "closed_at": 90.0, "outcome": "closed",
            "timings": [{"phase": "BOOTING", "stage": "open", "started_at": 1.0, "ended_at": 31.0, "took_s": 30.0},
                        {"phase": "WARMING", "stage": "open", "started_at": 31.0, "ended_at": 40.0, "took_s": 9.0},
                        {"phase": "READY", "stage": "open", "started_at": 40.0, "ended_at": 80.0, "took_s": 40.0},
                        {"phase": "RESTORING", "stage": "close", "started_at": 80.0, "ended_at": 90.0,
                         "took_s": 10.0}], **extra}


def test_a_finished_window_keeps_its_history_line_and_reads_what_learners_need() -> None:
    line = _line(container={"name": "x"}, degraded=None)
    finished = Finished.from_dict(line)
    assert json.dumps(finished.to_dict()) == json.dumps(line)
    assert Finished.from_dict(finished.to_dict()) == finished
    assert (finished.id, finished.profile, finished.outcome, finished.degraded) == ("w1", "eval", "closed", False)
    assert boot_took(finished) == 30.0
    times = Times()
    times.learn(finished)
    assert times.open_time("eval") == 40.0 and times.boots()["eval"]["count"] == 1
    assert times.saved() == {"resident_restore_s": 10.0, "measured_windows": 1}


def test_a_finished_window_of_an_older_or_odd_history_line_reads() -> None:
    old = {"id": "w0", "opened_at": 0.0, "outcome": "closed",  # gpuswapd 0.1: no profile, no stage, no start
           "timings": [{"phase": "READY", "started_at": 5.0}, "garbage", {"phase": 7}]}
    finished = Finished.from_dict(old)
    assert finished.profile == "default" and finished.start == "cold" and finished.closed_at is None
    assert [(t.phase, t.stage, t.started_at, t.took_s) for t in finished.timings] == [
        ("READY", "open", 5.0, None), (None, "open", None, None)]
    times = Times()
    times.learn(finished)
    times.learn(Finished.from_dict({}))  # nothing at all: nothing learnt, nothing raised
    assert times.open_time("default") == 5.0 and boot_took(finished) is None
    assert Finished.from_dict({"id": 5}).id is None


def test_a_plan_reads_back_what_it_writes_and_a_partial_one() -> None:
    plan = Plan(profile="default", kind="engine", units=("strata.service",), configured_units=("strata.service",),
                timers=("agent.timer",), jobs_running=(), resident_busy=None,
                container=PlanContainer("hyperqwen", "hyperqwen:latest", True, "http://127.0.0.1:18020/health"),
                vram=PlanVram("24.0 GiB", "1.0 GiB", "23.0 GiB", "20.0 GiB", "22.0 GiB",
                              (HeldBy(77, 1024, None),)),
                next_open="cold", parked=None, resident_files={"files": [], "cached": None, "prefetch": False},
                problems=(), warnings=("a warning",), settings={"from": "config", "caches": []})
    document = plan.to_dict()
    assert list(document) == ["profile", "kind", "units", "configured_units", "timers", "jobs_running",
                              "resident_busy", "container", "vram", "next_open", "parked", "resident_files",
                              "resident_cache", "problems", "warnings", "settings", "ok"]
    assert document["ok"] is True and document["vram"]["held_by_others"] == [{"pid": 77, "bytes": 1024,
                                                                              "unit": None}]
    assert Plan.from_dict(document) == plan
    assert json.dumps(Plan.from_dict(json.loads(json.dumps(document))).to_dict()) == json.dumps(document)
    refused = Plan.from_dict({**document, "problems": ["gpu: too little"]})
    assert not refused.ok and refused.to_dict()["ok"] is False
    bare = Plan.from_dict({"kind": "bare", "container": None})
    assert bare.container is None and bare.vram is None and bare.profile == "default" and bare.ok
