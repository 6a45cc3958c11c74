"""Re-opening from park against re-opening cold, alternating in one run with one gpuswapd.

    .venv/bin/python -m tests.benchmarks.park_bench [--cycles 10] [--lag S] [--boot-delay S] [--probe nvml]

On the test world, one gpuswapd with two engine profiles: the default one (``park.mode =
"stop"``, the engine is removed at close) and "warm" (``park.mode = "sleep"``, a second engine
with sleep mode, on port 18021, parked asleep at close). One priming window of "warm" boots and
parks its engine; then every cycle runs each variant once, in turn:

- **cold**: a window of the default profile: boot, warmup, verify; removed at close. The parked
  "warm" engine stays asleep beside it (it fits).
- **warm**: a window of "warm": WAKING (``/wake_up``, the canary), and back to sleep at close.
- **direct warm**: the same physical steps as a warm open and a close to park, back to back with
  10 ms polling and no daemon: drain, stop the timers, stop the resident, wait for the VRAM the
  parked engine does not hold, wake it, the canary; then sleep, read the VRAM, start and verify
  the resident, start the timers. gpuswapd's warm overhead is warm - direct warm, per cycle.

gpuswapd reads the card as the test world offers: its simulated ``nvidia-smi`` (a Python script,
about 60 ms a read), or with ``--probe nvml`` the path of a real card, gpuswapd's NVML probe with
pynvml's calls answered in-process from the ledger (about a millisecond, as libnvidia-ml;
tests/stack/nvml.py). The direct run reads the ledger in-process either way.

gpuswapd's windows are timed as in swap_bench: an acquire from a connected client until its
reply; a release until the running ``watch`` receives ``window_finished``. The cold/warm ratio
is taken per cycle.

What bounds the result (constants of the simulated world, not of gpuswapd):
  - cold: the engine's boot delay (ENGINE_BOOT_DELAY, 1.0 s, or --boot-delay) and 2 warmup + 1
    verify completions; warm: the engine's wake delay (ENGINE_WAKE_DELAY_1, 0.3 s) and one canary.
    The cold/warm ratio is mostly these constants (1.0 s against 0.3 s): it says how much a
    parked engine saves on this simulator, not on a real vLLM (minutes cold, seconds warm);
  - both: the VRAM release lag (0.5 s, or --lag) after the resident stops and after the engine
    sleeps (the card frees a sleeping engine's memory after the lag, as an exited process's), the
    resident's load and llama-swap's 0.25 s health poll at close, and the simulated nvidia-smi
    (~60 ms a read).
The direct warm variant pays these too: warm - direct warm is what gpuswapd adds.

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

from gpuswapd.config import Config, WindowConfig, load_config
from gpuswapd.parts.engine import CANARY_PROMPT, CANARY_SAMPLING, CANARY_TOKENS
from tests.benchmarks.clients import Events
from tests.benchmarks.report import (
    SPREAD_HEADER,
    add_world_options,
    alternate,
    measured,
    paired,
    parser,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.benchmarks.swap_bench import (
    Direct,
    _wait,
    complete,
    engine_env,
    free_bytes,
    gpuswapd_cycle,
    status,
    world,
    world_constants,
)
from tests.stack import nvml
from tests.stack.config import ENGINE_ENV, EVAL_PORT, stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import ENGINE_IMAGE, PROXY_PORT, Stack, StackError

WARM = "warm"
WARM_PORT = EVAL_PORT
START_SPACING_S = 2.5


def _post(port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _sleeping(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/is_sleeping")
        return bool(json.loads(conn.getresponse().read())["is_sleeping"])
    finally:
        conn.close()


class DirectWarm(Direct):
    """A warm open and a close to park, by hand against the real systems."""

    def __init__(self, stack: Stack, config: Config, engine: WindowConfig, port: int, residual: int) -> None:
        super().__init__(stack, config)
        self.engine, self.port, self.residual = engine, port, residual

    def open_warm(self) -> dict[str, float]:
        """Open a window by waking the parked engine; return each step's seconds."""
        steps: dict[str, float] = {}
        self.clear_resident(steps, self.config.gpu.window_needs - self.residual)

        def wake() -> None:
            if _post(self.port, "/wake_up")[0] != 200:
                raise StackError("the engine did not wake")
            _wait("awake", lambda: not _sleeping(self.port))
            v = self.engine.verify
            answer, _ = _post(self.port, "/v1/chat/completions", {
                "model": v.model, "max_tokens": CANARY_TOKENS,
                "messages": [{"role": "user", "content": CANARY_PROMPT}], **CANARY_SAMPLING})
            if answer != 200:
                raise StackError("the canary was not answered")

        self._timed(steps, "wake", wake)
        return steps

    def close_park(self) -> dict[str, float]:
        """Put the engine back to sleep and restore the resident; return each step's seconds."""
        steps: dict[str, float] = {}
        cfg, gpu = self.config, self.stack.paths.gpu

        def sleep() -> None:
            if _post(self.port, f"/sleep?level={self.engine.park.level}")[0] != 200:
                raise StackError("the engine did not sleep")
            _wait("asleep", lambda: _sleeping(self.port))
            # A sleeping engine's memory comes free some time after it says it sleeps (a card's lag;
            # the world's ledger has one): wait for it, up to park.settle, as gpuswapd does.
            _wait("room for the resident beside the sleeping engine",
                  lambda: free_bytes(gpu) >= cfg.gpu.resident_needs, timeout=self.engine.park.settle)

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
    at_baseline_but_parked(stack)
    time.sleep(START_SPACING_S)


def at_baseline_but_parked(stack: Stack) -> None:
    """The resident serves and the agent timers are armed; the only container is the parked engine."""
    stack.wait_baseline()
    running = stack.docker("ps", "-a", "--format", "{{.Names}}").stdout.split()
    if running not in ([], ["hyperqwen-warm"]):
        raise StackError(f"containers left over from the last window: {running}")


def warm_profile(stack: Stack, boot_delay: float | None) -> dict[str, dict[str, Any]]:
    """The "warm" profile: a second engine with sleep mode, parked asleep at close."""
    p = stack.paths
    # watch_interval long: the parked engine's watch must not look while the direct run wakes it.
    return {
        f"profiles__{WARM}": {"kind": "engine", "health_url": f"http://127.0.0.1:{WARM_PORT}/health",
                              "boot_timeout": "60s", "watch_interval": "10m", "max_restarts": 2},
        f"profiles__{WARM}__container": {
            "name": "hyperqwen-warm", "image": ENGINE_IMAGE, "create": True, "env_file": "",
            "env": engine_env(boot_delay, {**ENGINE_ENV, "PORT": str(WARM_PORT), "ENGINE_NAME": "hyperqwen-warm",
                                           "VLLM_SERVER_DEV_MODE": "1"}),
            "ports": {}, "network_mode": "host", "gpus": [], "volumes": {"/usr": "/usr:ro", str(p.gpu): "/gpu"},
            "shm_size": "", "command": [], "stop_timeout": "10s"},
        f"profiles__{WARM}__warmup": {"requests": 2, "prompt": "Write a haiku about GPUs.", "max_tokens": 64},
        f"profiles__{WARM}__verify": {"url": f"http://127.0.0.1:{WARM_PORT}/v1/chat/completions",
                                      "model": "hyperqwen", "prompt": "Reply with the single word: ready",
                                      "max_tokens": 64, "timeout": "30s"},
        f"profiles__{WARM}__park": {"mode": "sleep"},
    }


def warm_cycle(daemon: RunningDaemon, events: Events) -> dict[str, Any]:
    """A window of the warm profile; it must have woken the parked engine."""
    out = gpuswapd_cycle(daemon, events, holder="park-bench-warm", profile=WARM)
    if out["start"] != "warm":
        raise StackError(f"a warm re-open booted cold:\n{daemon.tail()}")
    return out


def run(cycles: int, lag: float | None = None, boot_delay: float | None = None,
        probe: str = "nvidia-smi") -> dict[str, Any]:
    """Prime the warm engine, then alternate cold, warm and direct warm windows."""
    stack = world(lag)
    result: dict[str, Any] = {"probe": probe}
    with stack.exclusive():
        stack.up()
        os.environ.update(stack.env())
        path = stack_config(stack, "park-bench", daemon={"linger": "0s"}, gpu={"probe": probe},
                            window__container={"env": engine_env(boot_delay)}, **warm_profile(stack, boot_delay))
        config = load_config(path)
        daemon = RunningDaemon(stack, path, path.parent / "gpuswapd.sock", env=nvml.ENV if probe == "nvml" else None,
                               program=nvml.PROGRAM if probe == "nvml" else None)
        events: Events | None = None
        direct: DirectWarm | None = None
        try:
            daemon.start()
            events = Events(daemon.socket)
            watch = events
            gpuswapd_cycle(daemon, watch, holder="park-bench-prime", profile=WARM)  # boots cold, parks
            parked = status(daemon.socket)["parked"]
            if parked is None:
                raise StackError(f"the engine was not parked:\n{daemon.tail()}")
            engine = config.profile(WARM).engine
            direct = DirectWarm(stack, config, engine, WARM_PORT, int(parked["residual_bytes"]))
            hand = direct
            result["constants"] = {**world_constants(stack, config.window.container.env,
                                                     config.window.warmup.requests),
                                   "engine_wake_delay_1_s": float(engine.container.env.get("ENGINE_WAKE_DELAY_1", 0.3))}
            # Warm windows are fast: without a pause between them the hand-run close once failed to
            # start strata (llama-swap's job ended 'dependency'); spacing the resident's restarts
            # avoided it (systemd's start limit is suspected).
            result["variants"] = alternate(cycles, [
                ("cold", lambda: gpuswapd_cycle(daemon, watch, holder="park-bench-cold")),
                ("warm", lambda: warm_cycle(daemon, watch)),
                ("direct_warm", lambda: {"open": hand.open_warm(), "close": hand.close_park()}),
            ], before=lambda _: spaced(stack))
            result["residual_bytes"] = parked["residual_bytes"]
            result["ooms"] = stack.ooms()
        except StackError as err:
            raise StackError(f"{err}\ngpuswapd's log ({daemon.log}):\n{daemon.tail(15)}") from err
        finally:
            if events is not None:
                events.close()
            if direct is not None:
                direct.close_all()
            daemon.stop()
            with contextlib.suppress(StackError):  # never hide what failed above
                stack.reset()
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Compute every figure; ratios and overheads per cycle."""
    v = result["variants"]
    cold, warm, hand = v["cold"], v["warm"], v["direct_warm"]
    d_open = [sum(d["open"].values()) for d in hand]
    d_close = [sum(d["close"].values()) for d in hand]

    def of(cycles: list[dict[str, Any]], key: str) -> list[float]:
        return [c[key] for c in cycles]

    series = {
        "cold.open": of(cold, "open_s"), "cold.open_daemon": of(cold, "open_daemon_s"),
        "warm.open": of(warm, "open_s"), "warm.open_daemon": of(warm, "open_daemon_s"),
        "warm.close": of(warm, "close_s"), "warm.close_daemon": of(warm, "close_daemon_s"),
        "direct.open": d_open, "direct.close": d_close,
        "warm.open_overhead": paired(of(warm, "open_s"), d_open, lambda a, b: a - b),
        "warm.open_overhead_daemon": paired(of(warm, "open_daemon_s"), d_open, lambda a, b: a - b),
        "warm.close_overhead": paired(of(warm, "close_s"), d_close, lambda a, b: a - b),
        "warm.close_overhead_daemon": paired(of(warm, "close_daemon_s"), d_close, lambda a, b: a - b),
        # The resident's restore varies by seconds on a loaded machine, in both variants.
        "warm.close_overhead_outside_restore": paired(
            [c["close_daemon_s"] - c["phases"].get("RESTORING", 0.0) for c in warm],
            [sum(d["close"].values()) - d["close"]["restore"] for d in hand], lambda a, b: a - b),
        "waking": [c["phases"].get("WAKING", 0.0) for c in warm], "direct.wake": [d["open"]["wake"] for d in hand],
        "ratio_cold_warm": paired(of(cold, "open_s"), of(warm, "open_s"), lambda a, b: a / b),
        "saved_cold_warm": paired(of(cold, "open_s"), of(warm, "open_s"), lambda a, b: a - b),
    }
    return {k: spread(values) for k, values in series.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the park benchmark."""
    cli = parser("park_bench", __doc__, cycles_of="a cold window, a warm window and a direct warm one")
    add_world_options(cli)
    cli.add_argument("--probe", choices=("nvidia-smi", "nvml"), default="nvidia-smi",
                     help="how gpuswapd reads the card: the world's nvidia-smi, or NVML answered from the ledger "
                          "(default nvidia-smi)")
    args = cli.parse_args(argv)
    result = measured("park_bench", run, args.cycles, args.lag, args.boot_delay, args.probe)
    if result is None:
        return 1
    stats = analyse(result)
    rows = [spread_row(label, stats[key]) for key, label in (
        ("cold.open", "cold re-open: acquire → READY (connected client)"),
        ("cold.open_daemon", "cold re-open (daemon's record)"),
        ("warm.open", "warm re-open: acquire → READY (connected client)"),
        ("warm.open_daemon", "warm re-open (daemon's record)"),
        ("ratio_cold_warm", "cold / warm, per cycle (x)"),
        ("saved_cold_warm", "cold - warm, per cycle"),
        ("direct.open", "direct warm open: inherent time"),
        ("warm.open_overhead", "warm open overhead = gpuswapd - direct, per cycle"),
        ("warm.open_overhead_daemon", "warm open overhead, daemon's record - direct"),
        ("waking", "  of it WAKING (wake + canary)"), ("direct.wake", "  direct wake + canary"),
        ("warm.close", "close to park: release → window_finished"),
        ("warm.close_daemon", "close to park (daemon's record)"),
        ("direct.close", "direct close to park: inherent time"),
        ("warm.close_overhead", "close overhead = gpuswapd - direct, per cycle"),
        ("warm.close_overhead_daemon", "close overhead, daemon's record - direct"),
        ("warm.close_overhead_outside_restore", "close overhead but for the resident's restore (record)"))]
    print(table(f"\nre-open from park against cold, {args.cycles} cycles, variants alternating (seconds); "
                f"probe {args.probe}",
                SPREAD_HEADER, rows))
    k = result["constants"]
    print(f"\nby construction: engine boot delay {k['engine_boot_delay_s']}s against wake delay "
          f"{k['engine_wake_delay_1_s']}s; VRAM release lag {k['release_lag_s']}s; "
          f"the parked engine kept {result['residual_bytes'] / 2**30:.2f} GiB")
    if result.get("ooms"):
        print(f"WARNING: CUDA out-of-memory recorded by the ledger: {result['ooms']}")
    path = write_results("park", {**result, "stats": stats})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
