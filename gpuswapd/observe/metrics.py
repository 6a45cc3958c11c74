"""Prometheus metrics: counters and histograms fed by the events and the finished windows, gauges read live.

The histograms of a window are observed once, from its finished record (the one ``history``
keeps), so a scrape agrees with ``gpuswapctl history --json`` to the millisecond. The gauges
(phase, leases, degraded, the resident left smaller, free VRAM) are read from the window at each collection, so they are
right even for a window adopted after a restart. Every series carries ``instance``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuswapd.events import LEASE_END_REASONS, Event
from gpuswapd.phases import Phase
from gpuswapd.record import Finished

if TYPE_CHECKING:
    from gpuswapd.window.window import Window

DEFAULT_INSTANCE = "default"  # the plain gpuswapd.service; gpuswapd@NAME exports instance="NAME"
SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 450.0,
           600.0)
OUTCOMES = ("closed", "rolled_back", "engine_failed", "refused", "recovered", "baseline_restored")


@dataclass(frozen=True)
class Now:
    """The window as it stands, for the gauges."""

    phase: str
    leases: int
    degraded: bool
    vram_free_bytes: int | None
    resident_degraded: bool = False
    resident_cached_ratio: float | None = None
    resident_down: tuple[tuple[str, str], ...] = ()  # (unit, cause) the reconcile found down


def window_now(window: Window) -> Now:
    """Read what the gauges show from the window."""
    rec, last = window.record, window.vram.last
    return Now(str(window.phase), len(window.leases()), bool(rec is not None and rec.degraded),
               None if last is None else last.free_bytes, window.known.changed is not None,
               window.files.ratio, tuple(sorted(window.resident_down.items())))


class _Live(Collector):
    """The gauges, read at each collection."""

    def __init__(self, now: Callable[[], Now], instance: str) -> None:
        self._now = now
        self._instance = instance

    def collect(self) -> Iterator[Metric]:
        now, inst = self._now(), self._instance
        phase = GaugeMetricFamily("gpuswapd_phase", "1 for the window's current phase, 0 for the others",
                                  labels=["instance", "phase"])
        for p in Phase:
            phase.add_metric([inst, str(p)], 1.0 if str(p) == now.phase else 0.0)
        yield phase
        yield _gauge("gpuswapd_leases", "Leases held now", inst, now.leases)
        yield _gauge("gpuswapd_degraded", "1 while the last window could not be closed cleanly yet", inst,
                     1.0 if now.degraded else 0.0)
        yield _gauge("gpuswapd_resident_degraded", "1 while the last close left the resident smaller than its "
                     "baseline (a smaller context, fewer slots, a model gone); the next close tries again", inst,
                     1.0 if now.resident_degraded else 0.0)
        vram = GaugeMetricFamily("gpuswapd_vram_free_bytes", "Free VRAM as last read (absent before the first read)",
                                 labels=["instance"])
        if now.vram_free_bytes is not None:
            vram.add_metric([inst], float(now.vram_free_bytes))
        yield vram
        cached = GaugeMetricFamily("gpuswapd_resident_cached_ratio", "Fraction of the resident's model files in the "
                                   "page cache, as last measured (plan, a close; absent before)", labels=["instance"])
        if now.resident_cached_ratio is not None:
            cached.add_metric([inst], now.resident_cached_ratio)
        yield cached
        down = GaugeMetricFamily("gpuswapd_resident_down", "1 for each resident unit found down while no window is "
                                 "open, by cause (stopped, failed, start_limit, masked): reported, never started by "
                                 "gpuswapd",
                                 labels=["instance", "unit", "cause"])
        for unit, cause in now.resident_down:
            down.add_metric([inst, unit, cause], 1.0)
        yield down

    def describe(self) -> Iterator[Metric]:
        """Name the families without reading the window (registration must not touch it)."""
        for name in ("gpuswapd_phase", "gpuswapd_leases", "gpuswapd_degraded", "gpuswapd_resident_degraded",
                     "gpuswapd_vram_free_bytes", "gpuswapd_resident_cached_ratio", "gpuswapd_resident_down"):
            yield GaugeMetricFamily(name, "")


def _gauge(name: str, doc: str, instance: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["instance"])
    family.add_metric([instance], value)
    return family


class Metrics:
    """gpuswapd's registry: what ``/metrics`` and the textfile expose."""

    def __init__(self, now: Callable[[], Now], version: str, instance: str = DEFAULT_INSTANCE) -> None:
        self.instance = instance
        r = self.registry = CollectorRegistry()
        self.phase_duration = Histogram(
            "gpuswapd_phase_duration_seconds", "Time spent in one phase of a window (one observation per timing)",
            ["instance", "phase", "stage", "profile"], buckets=SECONDS, registry=r)
        self.window_open = Histogram(
            "gpuswapd_window_open_seconds", "From the first acquire to READY", ["instance", "profile", "start"],
            buckets=SECONDS, registry=r)
        self.window_close = Histogram(
            "gpuswapd_window_close_seconds", "From the start of the close (linger excluded) to IDLE", ["instance"],
            buckets=SECONDS, registry=r)
        self.windows = Counter("gpuswapd_windows", "Windows finished, by outcome (as in history)",
                               ["instance", "outcome"], registry=r)
        self.lease_wait = Histogram("gpuswapd_lease_wait_seconds", "How long an acquire waited for its lease",
                                    ["instance"], buckets=SECONDS, registry=r)
        self.leases_ended = Counter("gpuswapd_leases_ended", "Leases ended, by reason", ["instance", "reason"],
                                    registry=r)
        self.baseline_restores = Counter("gpuswapd_baseline_restores", "Baseline restores, by cause: no state "
                                         "readable, or a lost record (what gpuswapd stopped comes back)",
                                         ["instance", "cause"], registry=self.registry)
        self.engine_restarts = Counter("gpuswapd_engine_restarts", "Engines restarted by the watchdog",
                                       ["instance"], registry=r)
        self.prefill_saved = Counter("gpuswapd_resident_prefill_tokens_saved",
                                     "Tokens of the resident's slots restored after a window, which its clients "
                                     "need not prefill again", ["instance"], registry=r)
        self.hook_dropped = Counter("gpuswapd_hook_events_dropped",
                                    "Events no hook ran for: hooks.command was already running 4 times",
                                    ["instance"], registry=r)
        Info("gpuswapd_build", "The running gpuswapd", ["instance"], registry=r).labels(instance).info(
            {"version": version})
        r.register(_Live(now, instance))
        # Series that exist from the start read 0, not "no data", on a dashboard.
        for outcome in OUTCOMES:
            self.windows.labels(instance, outcome)
        for reason in LEASE_END_REASONS:
            self.leases_ended.labels(instance, reason)
        self.engine_restarts.labels(instance)
        self.prefill_saved.labels(instance)
        self.hook_dropped.labels(instance)
        self.window_close.labels(instance)
        self.lease_wait.labels(instance)

    def on_event(self, event: Event) -> None:
        """Count what an event says (a bus subscriber)."""
        name, waited = str(event["event"]), event.get("waited_s")
        if name == "lease_granted" and isinstance(waited, (int, float)):
            self.lease_wait.labels(self.instance).observe(float(waited))
        elif name == "baseline_restore":
            self.baseline_restores.labels(self.instance, str(event.get("cause") or "state_unreadable")).inc()
        elif name == "engine_restarted":
            self.engine_restarts.labels(self.instance).inc()
        elif event.get("reason") in LEASE_END_REASONS and name.startswith("lease_"):
            self.leases_ended.labels(self.instance, event["reason"]).inc()

    def window_finished(self, record: Finished) -> None:
        """Observe a finished window from its record, as history keeps it."""
        inst = self.instance
        profile, start = record.profile, record.start
        timings = record.timings
        for t in timings:
            if t.took_s is not None:
                self.phase_duration.labels(inst, str(t.phase), t.stage, profile).observe(t.took_s)
        ready = next((t for t in timings if t.phase == str(Phase.READY)), None)
        if ready is not None and ready.started_at is not None and record.opened_at is not None:
            self.window_open.labels(inst, profile, start).observe(max(0.0, ready.started_at - record.opened_at))
        close = next((t for t in timings if t.stage == "close"), None)
        if close is not None and record.closed_at is not None and close.started_at is not None:
            self.window_close.labels(inst).observe(max(0.0, record.closed_at - close.started_at))
        self.windows.labels(inst, str(record.outcome)).inc()
        cache = record.document.get("cache")
        restore = cache.get("restore") if isinstance(cache, dict) else None
        tokens = restore.get("tokens") if isinstance(restore, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            self.prefill_saved.labels(inst).inc(tokens)

    def hook_event_dropped(self) -> None:
        """Count an event no hook could run for."""
        self.hook_dropped.labels(self.instance).inc()

    def exposition(self) -> bytes:
        """Render the registry in Prometheus's text format."""
        return generate_latest(self.registry)
