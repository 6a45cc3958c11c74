"""The gateway's Prometheus metrics, served at ``/metrics`` on its own address.

| metric | type | labels |
|---|---|---|
| ``gpuswapd_gateway_requests_total`` | counter | ``model``, ``tenant``, ``outcome`` |
| ``gpuswapd_gateway_waiting`` | gauge: requests waiting for a window now | |
| ``gpuswapd_gateway_in_flight`` | gauge: requests being answered now | ``tenant`` |
| ``gpuswapd_gateway_window_wait_seconds`` | histogram: the time a request waited for its window | ``tenant`` |
| ``gpuswapd_gateway_connections_cut_total`` | counter: connections cut before their request was read | ``reason`` |

A model name no tenant serves is counted as ``model="(unknown)"``: a client cannot grow the
series without bound; a request passed to llama-swap as it is (``/running``, ``/logs``, ...), as
``model="(passed)"``. The outcomes: ``ok``, ``client_error`` (a 4xx, the gateway's or the
upstream's), ``client_slow`` (its body did not come in time), ``not_reading`` (cut: it stopped
reading its answer), ``gone`` (it hung up), ``too_many`` (429), ``unavailable`` (503),
``upstream_error`` (the upstream failed or broke off), ``cut`` (a preemption ended it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0)
OUTCOMES = ("ok", "client_error", "client_slow", "unavailable", "too_many", "upstream_error", "cut", "gone",
            "not_reading")
UNKNOWN_MODEL = "(unknown)"
PASSED = "(passed)"  # a request passed to llama-swap as it is (not routed by model)


class Meters:
    """The gateway's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gpuswapd_gateway_requests", "Requests answered, by model, tenant and outcome",
                                ["model", "tenant", "outcome"], registry=self.registry)
        self.waiting = Gauge("gpuswapd_gateway_waiting", "Requests waiting for a window now", registry=self.registry)
        self.in_flight = Gauge("gpuswapd_gateway_in_flight", "Requests being answered now, by tenant", ["tenant"],
                               registry=self.registry)
        self.window_wait = Histogram("gpuswapd_gateway_window_wait_seconds",
                                     "Time a request waited for its model's window", ["tenant"],
                                     buckets=WAIT_BUCKETS, registry=self.registry)

        self.connections_cut = Counter("gpuswapd_gateway_connections_cut", "Connections cut before their request "
                                       "was read: slow, large (headers), crowded (too many heads coming), full",
                                       ["reason"], registry=self.registry)

    def cut(self, reason: str) -> None:
        """Count a connection cut before its request was read."""
        self.connections_cut.labels(reason).inc()

    def render(self) -> bytes:
        """Return the metrics in Prometheus's text format."""
        return generate_latest(self.registry)
