"""How long a GPU swap takes with gpuswapd, what it would take at the least, and by hand.

    .venv/bin/python -m tests.benchmarks.swap_bench [--cycles 10] [--no-naive] [--lag S] [--boot-delay S]

Each cycle, on the test world, runs every variant once, in turn (gpuswapd, direct, naive, then
again), each from the resident at its baseline:

- **gpuswapd**: an acquire from a client already connected to gpuswapd's socket, timed until its
  reply (READY); then a release from another connected client, timed until the running ``watch``
  subscription receives ``window_finished`` (resident verified, timers resumed). ``linger`` is 0
  so closing starts at once. The daemon's own view comes from its record: READY's start against
  the window's opening, IDLE against CLOSING's start.
- **direct**: the same physical steps back to back, with no daemon and 10 ms polling, straight
  against the real systems: StopUnit over D-Bus (waiting for JobRemoved), the VRAM ledger, the
  Docker SDK, the engine's /health, the same warmup and verify completions, docker stop/rm,
  StartUnit, a completion through llama-swap, the timers. This is the time the world needs by
  construction; gpuswapd's overhead is gpuswapd - direct, per cycle.
- **naive**: ``naive_swap.sh open|close``, the manual procedure with one-second polling; its ratio
  to gpuswapd is taken per cycle.

A fresh ``gpuswapctl`` adds its own start-up (the interpreter, imports) to what gpuswapd takes:
that is measured apart (``gpuswapctl status``, 10 times) and printed under the table.

What bounds the result (constants of the simulated world, not of gpuswapd):
  - the VRAM release lag (0.5 s, or --lag), waited for twice a cycle (resident gone, engine gone);
  - the engine's boot delay (ENGINE_BOOT_DELAY, 1.0 s, or --boot-delay), then 2 warmup and 1
    verify completions of 20 tokens, 3 a chunk, 5 ms between chunks;
  - the resident's load (llama-server with a tiny model) and llama-swap's 0.25 s health poll;
  - the simulated nvidia-smi: a Python script, about 60 ms a read, which gpuswapd polls in
    WAITING_VRAM (NVML on a real card reads in about a millisecond).
The direct variant pays all of these too: the overhead (gpuswapd - direct) is what gpuswapd adds.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from gi.repository import GLib
from pydbus import SystemBus

from gpuswapd.config import Config, load_config
from gpuswapd.ctl.client import Client
from tests.benchmarks.clients import Events, Ready, acquire, release
from tests.benchmarks.report import (
    RESULTS_DIR,
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
from tests.stack.config import ENGINE_ENV, stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.standins import ledger
from tests.stack.world import ENGINE_PORT, PROXY_PORT, RESIDENT_PORT, Stack, StackError

POLL_S = 0.01
HOLDER = "swap-bench"
NAIVE = Path(__file__).with_name("naive_swap.sh")
OPEN_STEPS = ("drain", "pause_timers", "stop_resident", "wait_vram", "boot", "warm")
CLOSE_STEPS = ("take_down", "wait_vram_close", "restore", "resume_timers")
# gpuswapd's phases against the direct steps that do the same physical work.
PHASE_STEPS = (("DRAINING", ("drain",)), ("PAUSING_TIMERS", ("pause_timers",)),
               ("STOPPING_RESIDENT", ("stop_resident",)), ("WAITING_VRAM", ("wait_vram",)),
               ("BOOTING", ("boot",)), ("WARMING", ("warm",)), ("CLOSING", ("take_down",)),
               ("WAITING_VRAM#2", ("wait_vram_close",)), ("RESTORING", ("restore",)),
               ("RESUMING_TIMERS", ("resume_timers",)))


def _wait(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not happen within {timeout:g}s")
        time.sleep(POLL_S)


# -- the direct run ------------------------------------------------------------------------------


class Bus:
    """systemd's manager on the world's bus (pydbus), waiting for jobs by their JobRemoved signal."""

    def __init__(self) -> None:
        self.bus = SystemBus()  # DBUS_SYSTEM_BUS_ADDRESS: the world's bus
        self.mgr = self.bus.get("org.freedesktop.systemd1", "/org/freedesktop/systemd1")[
            "org.freedesktop.systemd1.Manager"]
        self._done: dict[str, str] = {}
        self._cond = threading.Condition()
        self.bus.subscribe(sender="org.freedesktop.systemd1", iface="org.freedesktop.systemd1.Manager",
                           signal="JobRemoved", signal_fired=self._removed)
        self.mgr.Subscribe()
        self._loop = GLib.MainLoop()
        threading.Thread(target=self._loop.run, name="glib", daemon=True).start()

    def _removed(self, _sender: str, _obj: str, _iface: str, _signal: str, params: Any) -> None:
        _id, job, _unit, result = params
        with self._cond:
            self._done[job] = result
            self._cond.notify_all()

    def jobs(self, method: str, units: list[str], timeout: float = 60.0) -> None:
        """Queue StartUnit/StopUnit for every unit at once and wait until all jobs are done."""
        paths = [getattr(self.mgr, method)(unit, "replace") for unit in units]
        with self._cond:
            if not self._cond.wait_for(lambda: all(p in self._done for p in paths), timeout):
                raise StackError(f"{method} {units} not done within {timeout:g}s")
            results = [self._done.pop(p) for p in paths]
        if any(r != "done" for r in results):
            raise StackError(f"{method} {units}: {results}")

    def active(self, pattern: str) -> list[str]:
        """List the active units matching a glob."""
        return [row[0] for row in self.mgr.ListUnitsByPatterns(["active"], [pattern])]

    def close(self) -> None:
        """Stop the GLib loop."""
        self._loop.quit()


def free_bytes(gpu: Path) -> int:
    """Read the ledger's free memory (reading is what reaps dead holders, as nvidia-smi does)."""
    return int(ledger.snapshot(gpu)["free_bytes"])


def complete(port: int, model: str, prompt: str, max_tokens: int, timeout: float = 60.0) -> bool:
    """Stream one chat completion to the end; tell whether it carried answer text."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return False
        answered = False
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    answered |= bool((choice.get("delta") or {}).get("content"))
        return answered
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def http_status(port: int, path: str) -> int:
    """GET a local path; 0 when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


class Direct:
    """One window's physical steps, back to back, with 10 ms polling and no daemon."""

    def __init__(self, stack: Stack, config: Config) -> None:
        self.stack = stack
        self.config = config
        self.bus = Bus()
        self.docker = docker.from_env()
        self.timers: list[str] = []

    def _timed(self, steps: dict[str, float], name: str, action: Callable[[], None]) -> None:
        started = time.monotonic()
        action()
        steps[name] = time.monotonic() - started

    def clear_resident(self, steps: dict[str, float], need: int) -> None:
        """Drain, stop the timers and the resident, and wait until ``need`` bytes are free."""
        cfg, gpu = self.config, self.stack.paths.gpu

        def drain() -> None:
            _wait("an idle resident", lambda: http_status(RESIDENT_PORT, "/slots") == 200)

        self._timed(steps, "drain", drain)

        def pause() -> None:
            self.timers = sorted(t for p in cfg.timers.pause for t in self.bus.active(p))
            self.bus.jobs("StopUnit", self.timers)

        self._timed(steps, "pause_timers", pause)
        # One job: stopping strata stops llama-swap (Requires=) in the same transaction.
        self._timed(steps, "stop_resident", lambda: self.bus.jobs("StopUnit", ["strata.service"]))
        self._timed(steps, "wait_vram", lambda: _wait("VRAM", lambda: free_bytes(gpu) >= need))

    def open(self) -> dict[str, float]:
        """Open a window; return each step's seconds."""
        steps: dict[str, float] = {}
        cfg = self.config
        self.clear_resident(steps, cfg.gpu.window_needs)

        def boot() -> None:
            c = cfg.window.container
            api = self.docker.api
            host = api.create_host_config(binds=[f"{h}:{t}" for h, t in c.volumes.items()],
                                          network_mode=c.network_mode or None)
            api.create_container(image=c.image, name=c.name, environment=[f"{k}={v}" for k, v in c.env.items()],
                                 host_config=host)
            api.start(c.name)
            _wait("engine health", lambda: http_status(ENGINE_PORT, "/health") == 200)

        self._timed(steps, "boot", boot)

        def warm() -> None:
            w, v = cfg.window.warmup, cfg.window.verify
            for _ in range(w.requests):
                complete(ENGINE_PORT, v.model, w.prompt, w.max_tokens)
            if not complete(ENGINE_PORT, v.model, v.prompt, v.max_tokens):
                raise StackError("the engine did not answer the verifying completion")

        self._timed(steps, "warm", warm)
        return steps

    def close(self) -> dict[str, float]:
        """Close the window; return each step's seconds."""
        steps: dict[str, float] = {}
        cfg, gpu = self.config, self.stack.paths.gpu
        c = cfg.window.container

        def take_down() -> None:
            self.docker.api.stop(c.name, timeout=int(c.stop_timeout))
            self.docker.api.remove_container(c.name, force=True)

        self._timed(steps, "take_down", take_down)
        self._timed(steps, "wait_vram_close",
                    lambda: _wait("VRAM", lambda: free_bytes(gpu) >= cfg.gpu.resident_needs))
        r = cfg.resident.verify

        def restore() -> None:
            self.bus.jobs("StartUnit", ["llama-swap.service"])  # pulls strata in (Requires=)
            _wait("a resident completion", lambda: complete(PROXY_PORT, r.model, r.prompt, r.max_tokens))

        self._timed(steps, "restore", restore)
        self._timed(steps, "resume_timers", lambda: self.bus.jobs("StartUnit", self.timers))
        return steps

    def close_all(self) -> None:
        """Let go of the bus and Docker."""
        self.bus.close()
        self.docker.close()


# -- gpuswapd ------------------------------------------------------------------------------------


def status(socket: Path) -> dict[str, Any]:
    """Ask gpuswapd for its status over the socket."""
    with Client(str(socket)) as client:
        return client.request({"op": "status"})


def phase_times(window: dict[str, Any]) -> dict[str, float]:
    """Return each phase's seconds; the second WAITING_VRAM (closing) is WAITING_VRAM#2."""
    out: dict[str, float] = {}
    for t in window["timings"]:
        name = t["phase"] if t["phase"] not in out else f"{t['phase']}#2"
        if t.get("ended_at") is not None:
            out[name] = t["ended_at"] - t["started_at"]
    return out


def gpuswapd_cycle(daemon: RunningDaemon, events: Events, holder: str = HOLDER,
                   profile: str = "default") -> dict[str, Any]:
    """Acquire and release from connected clients; return the client's and the daemon's view."""
    events.clear()
    client = Ready(daemon.socket)
    started = time.monotonic()
    got, _ = client.send(acquire(holder, profile))
    open_s = got - started
    events.clear()
    client = Ready(daemon.socket)
    released = time.monotonic()
    client.send(release(holder))
    finished, event = events.finished()
    close_s = finished - released
    last = status(daemon.socket)["last"]
    if last["id"] != event["window"] or last["outcome"] != "closed" or last["error"]:
        raise StackError(f"the window did not close cleanly: {last['outcome']} {last['error']}\n{daemon.tail()}")
    phases = phase_times(last)
    ready = next(t for t in last["timings"] if t["phase"] == "READY")
    closing = next(t for t in last["timings"] if t["phase"] == "CLOSING")
    return {"open_s": open_s, "close_s": close_s,
            "open_daemon_s": ready["started_at"] - last["opened_at"],
            "close_daemon_s": last["closed_at"] - closing["started_at"], "phases": phases,
            "start": last.get("start")}


# -- naive ---------------------------------------------------------------------------------------


def naive_env(stack: Stack, config: Config) -> dict[str, str]:
    """The environment of naive_swap.sh: the world's, the ledger and the engine's env file."""
    env_file = RESULTS_DIR / "naive-engine.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in config.window.container.env.items()))
    return {**os.environ, **stack.env(), "GPU_DIR": str(stack.paths.gpu), "ENV_FILE": str(env_file),
            "TIMERS_FILE": str(RESULTS_DIR / "naive-timers"),
            "WINDOW_NEEDS_MIB": str(config.gpu.window_needs // 2**20),
            "RESIDENT_NEEDS_MIB": str(config.gpu.resident_needs // 2**20),
            "WARMUPS": str(config.window.warmup.requests)}


def naive_step(env: dict[str, str], step: str) -> float:
    """Run ``naive_swap.sh STEP``; return its wall time."""
    started = time.monotonic()
    out = subprocess.run(["bash", str(NAIVE), step], env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    if out.returncode != 0:
        raise StackError(f"naive_swap.sh {step} failed ({out.returncode}): {out.stderr}")
    return took


# -- the run -------------------------------------------------------------------------------------


def at_baseline(stack: Stack) -> None:
    """Wait until the resident serves, no container exists and the agent timers are armed."""
    stack.wait_baseline()
    if stack.docker("ps", "-aq").stdout.strip():
        raise StackError("a container is left over from the last run")


def cli_startup(daemon: RunningDaemon, times: int = 10) -> list[float]:
    """Time ``gpuswapctl status --json``: the interpreter start every client call pays."""
    out = []
    for _ in range(times):
        started = time.monotonic()
        daemon.ctl("status", "--json", check=True)
        out.append(time.monotonic() - started)
    return out


def probe_cost(stack: Stack, times: int = 10) -> list[float]:
    """Time one read of gpuswapd's VRAM probe here: two runs of the (simulated) nvidia-smi."""
    env = {**os.environ, **stack.env()}
    out = []
    for _ in range(times):
        started = time.monotonic()
        for query in ("--query-gpu=memory.used,memory.total,memory.free", "--query-compute-apps=pid,used_memory"):
            subprocess.run([str(stack.paths.bin / "nvidia-smi"), "-i", "0", query, "--format=csv,noheader,nounits"],
                           env=env, capture_output=True, check=True)
        out.append(time.monotonic() - started)
    return out


def world(lag: float | None) -> Stack:
    """The test world, with the simulated card's release lag set to ``lag`` (None: the world's)."""
    return Stack() if lag is None else Stack(release_lag_s=lag)


def engine_env(boot_delay: float | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment, with ENGINE_BOOT_DELAY set to ``boot_delay`` (None: the world's)."""
    out = dict(env if env is not None else ENGINE_ENV)
    if boot_delay is not None:
        out["ENGINE_BOOT_DELAY"] = str(boot_delay)
    return out


def ledger_lag(stack: Stack) -> Any:
    """The release lag the simulated card has now, as its ledger file says (None if it does not say)."""
    try:
        return json.loads((stack.paths.gpu / "ledger.json").read_text()).get("release_lag_s")
    except (OSError, ValueError):
        return None


def world_constants(stack: Stack, env: dict[str, str], warmups: int) -> dict[str, Any]:
    """The simulator's constants this run had: the ledger's lag as set, the engine's env."""
    return {"release_lag_s": ledger_lag(stack), "engine_boot_delay_s": float(env["ENGINE_BOOT_DELAY"]),
            "warmups": warmups, "tokens_per_chunk": int(env["ENGINE_TOKENS_PER_CHUNK"]),
            "chunk_delay_s": float(env["ENGINE_CHUNK_DELAY"])}


def run(cycles: int, naive: bool, lag: float | None = None, boot_delay: float | None = None) -> dict[str, Any]:
    """Run the cycles, alternating the variants; return every measurement."""
    stack = world(lag)
    with stack.exclusive():
        stack.up()
        os.environ.update(stack.env())  # pydbus's SystemBus() and docker.from_env() read these
        config_path = stack_config(stack, "swap-bench", daemon={"linger": "0s"},
                                   window__container={"env": engine_env(boot_delay)})
        config = load_config(config_path)
        daemon = RunningDaemon(stack, config_path, config_path.parent / "gpuswapd.sock")
        direct = Direct(stack, config)
        env = naive_env(stack, config)
        result: dict[str, Any] = {"config": str(config_path)}
        events: Events | None = None
        try:
            daemon.start()
            events = Events(daemon.socket)
            result["constants"] = world_constants(stack, config.window.container.env, config.window.warmup.requests)
            result["cli_startup_s"] = cli_startup(daemon)
            result["vram_probe_s"] = probe_cost(stack)
            watch = events
            variants: list[tuple[str, Any]] = [
                ("gpuswapd", lambda: gpuswapd_cycle(daemon, watch)),
                ("direct", lambda: {"open": direct.open(), "close": direct.close()})]
            if naive:
                variants.append(("naive", lambda: {"open_s": naive_step(env, "open"),
                                                   "close_s": naive_step(env, "close")}))
            result["variants"] = alternate(cycles, variants, before=lambda _: at_baseline(stack))
            result["ooms"] = stack.ooms()
        finally:
            if events is not None:
                events.close()
            daemon.stop()
            direct.close_all()
            stack.reset()
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Compute the open/close figures, the overheads (per cycle) and the per-phase comparison."""
    v = result["variants"]
    g, d = v["gpuswapd"], v["direct"]
    series: dict[str, list[float]] = {}
    for side in ("open", "close"):
        g_client = [c[f"{side}_s"] for c in g]
        g_daemon = [c[f"{side}_daemon_s"] for c in g]
        direct = [sum(c[side].values()) for c in d]
        series[f"{side}.gpuswapd"] = g_client
        series[f"{side}.gpuswapd_daemon"] = g_daemon
        series[f"{side}.direct"] = direct
        series[f"{side}.overhead"] = paired(g_client, direct, lambda a, b: a - b)
        series[f"{side}.overhead_daemon"] = paired(g_daemon, direct, lambda a, b: a - b)
        if "naive" in v:
            naive = [c[f"{side}_s"] for c in v["naive"]]
            series[f"{side}.naive"] = naive
            series[f"{side}.naive_ratio"] = paired(naive, g_client, lambda a, b: a / b)
    # The resident's restore (llama-server's load and first completion, on the CPU) varies by
    # seconds from one close to the next on a loaded machine, in both variants: the rest of the
    # close is compared apart.
    series["close.overhead_outside_restore"] = paired(
        [c["close_daemon_s"] - c["phases"].get("RESTORING", 0.0) for c in g],
        [sum(c["close"].values()) - c["close"]["restore"] for c in d], lambda a, b: a - b)
    for phase, steps in PHASE_STEPS:
        gp = [c["phases"].get(phase, 0.0) for c in g]
        dp = [sum(c["open"].get(s, 0.0) + c["close"].get(s, 0.0) for s in steps) for c in d]
        series[f"phase.{phase}.gpuswapd"] = gp
        series[f"phase.{phase}.direct"] = dp
        series[f"phase.{phase}.extra"] = paired(gp, dp, lambda a, b: a - b)
    series["cli_startup"] = result["cli_startup_s"]
    series["vram_probe"] = result["vram_probe_s"]
    return {name: spread(values) for name, values in series.items()}


def print_report(result: dict[str, Any], stats: dict[str, Any]) -> None:
    """Print the tables."""
    rows: list[tuple[Any, ...]] = []
    for side, what in (("open", "acquire → READY"), ("close", "release → resident verified, IDLE")):
        rows.append((f"{side}: {what}",) + (None,) * 6)
        for key, label in (("gpuswapd", "gpuswapd (connected client / watch event)"),
                           ("gpuswapd_daemon", "gpuswapd (daemon's own record)"),
                           ("direct", "direct: inherent time of the world"),
                           ("overhead", "overhead = gpuswapd - direct, per cycle"),
                           ("overhead_daemon", "overhead, daemon's record - direct"),
                           ("overhead_outside_restore", "overhead but for the resident's restore (record)"),
                           ("naive", "naive_swap.sh"), ("naive_ratio", "naive / gpuswapd, per cycle (x)")):
            s = stats.get(f"{side}.{key}")
            if s and s["n"]:
                rows.append(spread_row(f"  {label}", s))
    cycles = len(result["variants"]["gpuswapd"])
    print(table(f"\nGPU swap, {cycles} cycles, variants alternating (seconds)", SPREAD_HEADER, rows))
    prows = []
    for phase, steps in PHASE_STEPS:
        g, d, e = (stats[f"phase.{phase}.{k}"] for k in ("gpuswapd", "direct", "extra"))
        prows.append((phase, g["median"], f"{'+'.join(steps)}", d["median"], e["median"], e["p10"], e["p90"]))
    print(table("\nwhere the time goes (medians; extra = gpuswapd - direct per cycle, seconds)",
                ("gpuswapd phase", "gpuswapd", "direct step", "direct", "extra", "extra p10", "extra p90"), prows))
    k = result["constants"]
    print(f"\nby construction: VRAM release lag {k['release_lag_s']}s; engine boot delay {k['engine_boot_delay_s']}s; "
          f"warmup {k['warmups']} + 1 verify completions; {k['tokens_per_chunk']} tokens per chunk, "
          f"{k['chunk_delay_s']}s between chunks")
    print(table("\noutside the window", SPREAD_HEADER, [
        spread_row("a fresh gpuswapctl's start-up (status --json wall)", stats["cli_startup"]),
        spread_row("one VRAM read by the simulated nvidia-smi (2 runs)", stats["vram_probe"])]))
    if result.get("ooms"):
        print(f"WARNING: CUDA out-of-memory recorded by the ledger: {result['ooms']}")


def main(argv: list[str] | None = None) -> int:
    """Run the swap benchmark."""
    cli = parser("swap_bench", __doc__, cycles_of="gpuswapd, direct and naive windows")
    cli.add_argument("--no-naive", action="store_true", help="leave out the naive shell script")
    add_world_options(cli)
    args = cli.parse_args(argv)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    result = measured("swap_bench", run, args.cycles, not args.no_naive, args.lag, args.boot_delay)
    if result is None:
        return 1
    stats = analyse(result)
    print_report(result, stats)
    path = write_results("swap", {**result, "stats": stats, "gpuswapctl": str(BIN / "gpuswapctl")})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
