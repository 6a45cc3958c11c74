"""The metrics: the names and types of the exposition, and a window on fakes seen as history sees it."""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuswapd import __version__
from gpuswapd.events import EventBus, to_event
from gpuswapd.observe.metrics import Metrics, Now, window_now
from gpuswapd.phases import Phase
from gpuswapd.record import Finished
from tests.fakes import FakeWorld, running, settle

DASHBOARD = Path(__file__).resolve().parents[3] / "packaging" / "grafana" / "gpuswapd.json"
TABLE = {  # name -> (type, labels besides instance)
    "gpuswapd_phase_duration_seconds": ("histogram", {"phase", "stage", "profile"}),
    "gpuswapd_window_open_seconds": ("histogram", {"profile", "start"}),
    "gpuswapd_window_close_seconds": ("histogram", set()),
    "gpuswapd_windows": ("counter", {"outcome"}),
    "gpuswapd_lease_wait_seconds": ("histogram", set()),
    "gpuswapd_leases": ("gauge", set()),
    "gpuswapd_leases_ended": ("counter", {"reason"}),
    "gpuswapd_engine_restarts": ("counter", set()),
    "gpuswapd_phase": ("gauge", {"phase"}),
    "gpuswapd_degraded": ("gauge", set()),
    "gpuswapd_vram_free_bytes": ("gauge", set()),
    "gpuswapd_build_info": ("gauge", {"version"}),  # an info metric, as the text format carries it
    "gpuswapd_hook_events_dropped": ("counter", set()),
}
IDLE = Now("IDLE", 0, False, 3 * 2**30)


def families(metrics: Metrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}


def test_the_exposition_has_every_name_of_the_table_with_its_type_and_instance() -> None:
    m = Metrics(lambda: IDLE, __version__)
    m.window_finished(Finished.from_dict({
                       "id": "w", "opened_at": 0.0, "closed_at": 9.0, "outcome": "closed", "start": "cold",
                       "timings": [{"phase": "DRAINING", "stage": "open", "started_at": 0.0, "ended_at": 1.0,
                                    "took_s": 1.0},
                                   {"phase": "READY", "stage": "open", "started_at": 1.0, "ended_at": 2.0,
                                    "took_s": 1.0},
                                   {"phase": "CLOSING", "stage": "close", "started_at": 2.0, "ended_at": 9.0,
                                    "took_s": 7.0}]}))
    m.on_event(to_event("lease_granted", "info", {"waited_s": 1.5}, {}))
    found = families(m)
    assert set(TABLE) <= set(found), set(TABLE) - set(found)
    for name, (kind, labels) in TABLE.items():
        family = found[name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            assert sample.labels["instance"] == "default", sample
            assert labels <= set(sample.labels), (name, sample.labels)
    assert found["gpuswapd_build_info"].samples[0].labels["version"] == __version__
    phase = {s.labels["phase"]: s.value for s in found["gpuswapd_phase"].samples}
    assert phase == {str(p): 1.0 if p is Phase.IDLE else 0.0 for p in Phase}
    assert found["gpuswapd_vram_free_bytes"].samples[0].value == 3 * 2**30
    assert max(s.value for s in found["gpuswapd_phase_duration_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["le"] == "600.0") == 1.0
    # Every reason and outcome reads 0 from the start, not "no data".
    reasons = {s.labels["reason"] for s in found["gpuswapd_leases_ended"].samples if s.name.endswith("_total")}
    assert reasons == {"released", "expired", "unit_gone", "closed", "preempted"}


def test_a_window_on_fakes_agrees_with_its_history_record() -> None:
    world = FakeWorld()
    bus = EventBus()

    async def main() -> Metrics:
        async with running(world.window()) as w:
            m = Metrics(lambda: window_now(w), __version__)
            w.finished.append(m.window_finished)
            bus.subscribe(m.on_event)
            lease = await w.acquire("job", 60)
            assert families(m)["gpuswapd_leases"].samples[0].value == 1
            assert {s.labels["phase"]: s.value for s in families(m)["gpuswapd_phase"].samples}["READY"] == 1
            await w.release(lease.id)
            bus.publish(to_event("lease_released", "info", {}, {}))
            await settle(w)
        return m

    m = asyncio.run(asyncio.wait_for(main(), 30))
    [record] = world.store.history_records
    found = families(m)
    recorded: dict[tuple[str, str], list[float]] = defaultdict(list)
    for t in record["timings"]:
        recorded[(t["phase"], t["stage"])].append(t["took_s"])
    seen: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for s in found["gpuswapd_phase_duration_seconds"].samples:
        if not s.name.endswith("_bucket"):
            seen[(s.labels["phase"], s.labels["stage"])][s.name.rpartition("_")[2]] = s.value
    assert set(seen) == set(recorded)
    for key, took in recorded.items():
        assert seen[key]["count"] == len(took)
        assert abs(seen[key]["sum"] - sum(took)) < 0.010
    windows = {s.labels["outcome"]: s.value for s in found["gpuswapd_windows"].samples if s.name.endswith("_total")}
    assert windows["closed"] == 1 and sum(windows.values()) == 1
    assert found["gpuswapd_leases"].samples[0].value == 0
    ended = {s.labels["reason"]: s.value for s in found["gpuswapd_leases_ended"].samples if s.name.endswith("_total")}
    assert ended["released"] == 1
    opened = [s for s in found["gpuswapd_window_open_seconds"].samples if s.name.endswith("_count")]
    assert [(s.labels["profile"], s.labels["start"], s.value) for s in opened] == [("default", "cold", 1.0)]


def test_the_dashboard_is_json_and_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 8
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "info": ("_info",)}
    by_family = {f.name: {f.name + suffix for suffix in suffixes.get(f.type, ("",))}
                 for f in Metrics(lambda: IDLE, __version__).registry.collect()}
    used = {word for expr in exprs for word in re.findall(r"\bgpuswapd_[a-z_]+", expr)}
    assert used and used <= set().union(*by_family.values()), used - set().union(*by_family.values())
    assert not [f for f, names in by_family.items() if not names & used]  # and every metric has a panel
