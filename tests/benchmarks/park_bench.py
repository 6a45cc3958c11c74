"""Re-opening from park against re-opening cold, side by side in one run.

    .venv/bin/python -m tests.benchmarks.park_bench [--cycles 5]

On the test world, with an engine that offers sleep mode:

- **cold**: gpuswapd with ``window.park.mode = "stop"``: each acquire boots the engine (boot delay,
  warmup, verify), each release removes it.
- **warm**: gpuswapd with ``mode = "sleep"``: after one priming window the engine is parked; each
  acquire wakes it (WAKING: ``/wake_up``, the canary), each release puts it back to sleep.
- **direct warm**: the same physical steps as a warm open and a close to park, back to back with
  10 ms polling and no daemon: drain, stop the timers, stop the resident, wait for the VRAM the
  parked engine does not hold, wake it, the canary; then sleep, read the VRAM, start and verify the
  resident, start the timers. gpuswapd's warm overhead is warm - direct warm, paired per cycle.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import sys
import time
from typing import Any

from gpuswapd.config import Config, load_config
from gpuswapd.engine import CANARY_PROMPT, CANARY_SAMPLING, CANARY_TOKENS
from tests.benchmarks.report import measured, parser, spread, spread_row, table, write_results
from tests.benchmarks.swap_bench import (
    Direct,
    _wait,
    at_baseline,
    complete,
    free_bytes,
    gpuswapd_cycle,
    status,
)
from tests.stack.config import ENGINE_ENV, stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import ENGINE_PORT, PROXY_PORT, Stack, StackError

SLEEPY = {**ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"}
START_SPACING_S = 2.5


def _post(path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", ENGINE_PORT, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _sleeping() -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", ENGINE_PORT, timeout=5)
    try:
        conn.request("GET", "/is_sleeping")
        return bool(json.loads(conn.getresponse().read())["is_sleeping"])
    finally:
        conn.close()


class DirectWarm(Direct):
    """A warm open and a close to park, by hand against the real systems."""

    def __init__(self, stack: Stack, config: Config, residual: int) -> None:
        super().__init__(stack, config)
        self.residual = residual

    def open_warm(self) -> dict[str, float]:
        steps: dict[str, float] = {}
        cfg = self.config
        self.clear_resident(steps, cfg.gpu.window_needs - self.residual)

        def wake() -> None:
            if _post("/wake_up")[0] != 200:
                raise StackError("the engine did not wake")
            _wait("awake", lambda: not _sleeping())
            v = cfg.window.verify
            status, _ = _post("/v1/chat/completions", {"model": v.model, "max_tokens": CANARY_TOKENS,
                                                       "messages": [{"role": "user", "content": CANARY_PROMPT}],
                                                       **CANARY_SAMPLING})
            if status != 200:
                raise StackError("the canary was not answered")

        self._timed(steps, "wake", wake)
        return steps

    def close_park(self) -> dict[str, float]:
        steps: dict[str, float] = {}
        cfg, gpu = self.config, self.stack.paths.gpu

        def sleep() -> None:
            if _post(f"/sleep?level={cfg.window.park.level}")[0] != 200:
                raise StackError("the engine did not sleep")
            _wait("asleep", _sleeping)
            if free_bytes(gpu) < cfg.gpu.resident_needs:
                raise StackError("the resident would not fit beside the sleeping engine")

        self._timed(steps, "sleep", sleep)
        r = cfg.resident.verify

        def restore() -> None:
            self.bus.jobs("StartUnit", ["llama-swap.service"])
            _wait("a resident completion", lambda: complete(PROXY_PORT, r.model, r.prompt, r.max_tokens))

        self._timed(steps, "restore", restore)
        self._timed(steps, "resume_timers", lambda: self.bus.jobs("StartUnit", self.timers))
        return steps


def spaced(stack: Stack) -> None:
    """Wait for the resident, then long enough that its starts stay under the start limit."""
    stack.wait_baseline()
    time.sleep(START_SPACING_S)


def _daemon(stack: Stack, name: str, mode: str) -> tuple[RunningDaemon, Config]:
    # watch_interval long: the parked engine's watch must not look while the direct run wakes it.
    path = stack_config(stack, name, daemon={"linger": "0s"}, window={"watch_interval": "10m"},
                        window__park={"mode": mode}, window__container={"env": SLEEPY})
    return RunningDaemon(stack, path, path.parent / "gpuswapd.sock"), load_config(path)


def run(cycles: int) -> dict[str, Any]:
    stack = Stack()
    result: dict[str, Any] = {"cold": [], "warm": [], "direct_warm": []}
    with stack.exclusive():
        stack.up()
        os.environ.update(stack.env())
        cold, _ = _daemon(stack, "park-bench-cold", "stop")
        warm, config = _daemon(stack, "park-bench-warm", "sleep")
        try:
            cold.start()
            for n in range(cycles):
                at_baseline(stack)
                result["cold"].append(gpuswapd_cycle(cold))
                print(f"cold {n + 1}/{cycles}: open {result['cold'][-1]['open_s']:.2f}s", file=sys.stderr)
            cold.stop()
            warm.start()
            gpuswapd_cycle(warm)  # prime: boots cold, parks
            parked = status(warm.socket)["parked"]
            if parked is None:
                raise StackError(f"the engine was not parked:\n{warm.tail()}")
            direct = DirectWarm(stack, config, int(parked["residual_bytes"]))
            try:
                for n in range(cycles):
                    # Warm windows are fast: without a pause between them the hand-run close once
                    # failed to start strata (llama-swap's job ended 'dependency'); spacing the
                    # resident's restarts avoided it (systemd's start limit is suspected).
                    spaced(stack)
                    g = gpuswapd_cycle(warm)
                    if status(warm.socket)["last"]["start"] != "warm":
                        raise StackError(f"a warm re-open booted cold:\n{warm.tail()}")
                    result["warm"].append(g)
                    spaced(stack)
                    result["direct_warm"].append({"open": direct.open_warm(), "close": direct.close_park()})
                    print(f"warm {n + 1}/{cycles}: open {g['open_s']:.2f}s close {g['close_s']:.2f}s", file=sys.stderr)
            finally:
                direct.close_all()
            result["residual_bytes"] = parked["residual_bytes"]
            result["ooms"] = stack.ooms()
        except StackError as err:
            raise StackError(f"{err}\ngpuswapd's log ({warm.log}):\n{warm.tail(15)}") from err
        finally:
            cold.stop()
            warm.stop()
            with contextlib.suppress(StackError):  # never hide what failed above
                stack.reset()
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    series: dict[str, list[float]] = {}
    for c in result["cold"]:
        series.setdefault("cold.open", []).append(c["open_s"])
        series.setdefault("cold.open_daemon", []).append(c["open_daemon_s"])
    for g, d in zip(result["warm"], result["direct_warm"], strict=True):
        d_open, d_close = sum(d["open"].values()), sum(d["close"].values())
        for key, value in (("warm.open", g["open_s"]), ("warm.open_daemon", g["open_daemon_s"]),
                           ("warm.close", g["close_s"]), ("warm.close_daemon", g["close_daemon_s"]),
                           ("direct.open", d_open), ("direct.close", d_close),
                           ("warm.open_overhead", g["open_s"] - d_open),
                           ("warm.open_overhead_daemon", g["open_daemon_s"] - d_open),
                           ("warm.close_overhead", g["close_s"] - d_close),
                           ("warm.close_overhead_daemon", g["close_daemon_s"] - d_close),
                           ("direct.wake", d["open"]["wake"]), ("waking", g["phases"].get("WAKING", 0.0))):
            series.setdefault(key, []).append(value)
    stats: dict[str, Any] = {k: spread(v) for k, v in series.items()}
    stats["ratio_cold_warm"] = stats["cold.open"]["median"] / stats["warm.open"]["median"]
    return stats


def main(argv: list[str] | None = None) -> int:
    args = parser("park_bench", __doc__, cycles_of="windows per variant").parse_args(argv)
    result = measured("park_bench", run, args.cycles)
    if result is None:
        return 1
    stats = analyse(result)
    rows = [spread_row(label, stats[key]) for key, label in (
        ("cold.open", "cold re-open: acquire → READY (gpuswapctl wall)"),
        ("cold.open_daemon", "cold re-open (daemon's record)"),
        ("warm.open", "warm re-open: acquire → READY (gpuswapctl wall)"),
        ("warm.open_daemon", "warm re-open (daemon's record)"),
        ("direct.open", "direct warm open: inherent time"),
        ("warm.open_overhead", "warm open overhead = gpuswapd - direct"),
        ("warm.open_overhead_daemon", "warm open overhead, daemon's record - direct"),
        ("waking", "  of it WAKING (wake + canary)"), ("direct.wake", "  direct wake + canary"),
        ("warm.close", "close to park: release → resident verified"),
        ("warm.close_daemon", "close to park (daemon's record)"),
        ("direct.close", "direct close to park: inherent time"),
        ("warm.close_overhead", "close overhead = gpuswapd - direct"),
        ("warm.close_overhead_daemon", "close overhead, daemon's record - direct"))]
    print(table(f"\nre-open from park against cold, {args.cycles} cycles each (seconds)",
                ("", "min", "median", "max"), rows))
    print(f"\ncold / warm re-open (medians, gpuswapctl wall): {stats['ratio_cold_warm']:.2f}x; "
          f"the parked engine kept {result['residual_bytes'] / 2**30:.2f} GiB")
    if result.get("ooms"):
        print(f"WARNING: CUDA out-of-memory recorded by the ledger: {result['ooms']}")
    path = write_results("park", {**result, "stats": stats})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
