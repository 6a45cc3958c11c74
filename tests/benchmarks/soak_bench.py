"""A soak of the front door on the test world: mixed models, both daemons socket-activated and killed with -9.

    .venv/bin/python -m tests.benchmarks.soak_bench [--cycles 1] [--minutes 10] [--policies old,new]
                                                   [--old REV] [--every 20-60] [--boot-delay S] [--seed 37]
                                                   [--session 1-1|LOW-HIGH|0] [--arrivals RATE]

On the test world, each policy in turn (one card: one at a time), gpuswapd and gpuswapd-gateway
run as their shipped units, socket-activated in the world's systemd (gpuswapd.socket on
/run/gpuswapd/gpuswapd.sock, gpuswapd-gateway.socket on 127.0.0.1:8080), with the world's drop-ins
(this checkout's interpreter, the world's paths). "new" is this checkout; "old" is both daemons of
``--old`` (by default bcfa671, the last gateway without a schedule), run from ``git archive REV
gpuswapd``. The configuration is the same for both: the world's resident, the default engine
(hyperqwen) and a second engine profile (eval, qwen-eval), the gateway's defaults (``idle`` 5 min,
``hold`` 15 min).

Six clients, each sending one request after another through the gateway, ask for the resident's
model (strata), the default engine's and the second profile's in 5:4:1, half of them streamed,
for ``--minutes``. By default each request draws its model; with ``--session LOW-HIGH`` a client
keeps the model it drew for a session of LOW-HIGH requests (an agent's conversation), then draws
the next; with ``--session 0`` each client asks for one model all along (three clients the
resident's, two the default engine's, one the second profile's: 5:4:1 rounded to six). With
``--arrivals RATE`` there are no closed-loop clients: requests arrive at RATE a second (Poisson,
drawn from ``--seed``), models 5:4:1, half streamed, each sent at its time on a thread of its own
whatever became of the others, so both policies get exactly the same requests.

Every 20-60 s (``--every``; drawn from ``--seed``, the same draws for each policy) one of three
things happens: gpuswapd's main process is killed with SIGKILL (systemd's
KillUnit; Restart=on-failure and its socket bring it back), the gateway's is (its socket starts it
again on the next connection), or the engine that runs is killed (``docker kill``; gpuswapd's
watchdog starts it again). Then the clients finish the request they are in, both daemons are
stopped by systemd, and the resident and the timers must be back.

Per policy: windows (gpuswapd's history: windows opened during the soak) and how each ended (its
profile, its outcome, and whether it switched straight to the next), engine boots (the
simulator's count), requests sent and answered, the answered ones' latency (p50, p90, max), and
the failed ones, split as the rule of the soak has it: 429s; those in flight through a killed
gateway (a transport error within 2 s after a kill of the gateway, for a request sent before
it); and the rest, each with its error.

What bounds the result: the price of a swap is the world's (an engine boots in ``--boot-delay``,
1 s by default, against a real vLLM's minute; the resident is llama-server on the CPU with a tiny
model), so the schedule's residency, a multiple of that price, is short here and the windows are
many more than a real box would see; the clients are closed loops (each waits for its answer),
so a policy that answers slower also sends less; the old policy's run comes first and the new
one's second, on the same world, not alternated within a cycle's minutes; the gateway's drain
probe and every wait are the real daemons'.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.benchmarks.report import add_world_options, parser, quantile, table, write_results
from tests.benchmarks.swap_bench import engine_env, world
from tests.stack.config import profile_sections, stack_config
from tests.stack.daemon import BIN
from tests.stack.gateway import SYSTEM_PYTHON, URL, gateway_sections
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import OTHER_TIMER, REPO, Stack, StackError

OLD = "bcfa671"  # the last gateway without a schedule (as schedule_bench's old policy)
MODELS = ("strata", "hyperqwen", "qwen-eval")
WEIGHTS = (5, 4, 1)
CLIENTS = 6
DEDICATED = (0, 0, 0, 1, 1, 2)  # --session 0: each client's one model, 5:4:1 rounded to six clients (3:2:1)
ENGINES = ("hyperqwen", "qwen-eval")  # the containers an engine death may hit
SOCKET = "/run/gpuswapd/gpuswapd.sock"  # inside the world
THROUGH_KILL_S = 2.0  # a transport error this soon after a kill of the gateway is that kill's


@dataclass
class Asked:
    """One request through the gateway and how it ended."""

    model: str
    stream: bool
    sent: float
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer (a transport error)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class Chaos:
    """What was done to the box, and when (monotonic)."""

    at: float
    kind: str  # gpuswapd, gateway, engine
    done: str


@dataclass
class Soak:
    policy: str
    asked: list[Asked] = field(default_factory=list)
    chaos: list[Chaos] = field(default_factory=list)
    windows: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # "profile: outcome" -> windows that ended so
    boots: int = 0
    back: dict[str, str] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)


def draws(seed: int, seconds: float, every: tuple[float, float]) -> list[tuple[float, str]]:
    """The chaos schedule: (seconds since the start, what) until ``seconds``; the same for every policy."""
    rng = random.Random(seed)
    out, at = [], 0.0
    while True:
        at += rng.uniform(*every)
        if at >= seconds:
            return out
        out.append((at, rng.choice(("gpuswapd", "gateway", "engine"))))


def classify(asked: list[Asked], chaos: list[Chaos]) -> dict[str, list[Asked]]:
    """Split the requests: answered, 429, in flight through a killed gateway, failed."""
    kills = [c.at for c in chaos if c.kind == "gateway" and c.done == "killed"]
    out: dict[str, list[Asked]] = {"ok": [], "429": [], "gateway_killed": [], "failed": []}
    for a in asked:
        if a.ok:
            out["ok"].append(a)
        elif a.status == 429:
            out["429"].append(a)
        elif a.status in (None, 200) and any(a.sent < k <= a.ended <= k + THROUGH_KILL_S for k in kills):
            out["gateway_killed"].append(a)  # no answer, or a stream cut, as its gateway died
        else:
            out["failed"].append(a)
    return out


# -- the clients -----------------------------------------------------------------------------------


def ask(http: httpx.Client, model: str, stream: bool) -> Asked:
    """Send one chat completion through the gateway; read all of it."""
    asked = Asked(model, stream, time.monotonic())
    body: dict[str, Any] = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}
    try:
        if stream:
            with http.stream("POST", f"{URL}/v1/chat/completions", json={**body, "stream": True}) as reply:
                asked.status = reply.status_code
                if reply.status_code != 200:
                    asked.error = reply.read().decode(errors="replace")[:300]
                else:
                    lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
                    if not lines or lines[-1].strip() != "data: [DONE]":
                        asked.error = f"stream ended without [DONE] after {len(lines)} events"
                    elif any('"error"' in line for line in lines):
                        asked.error = next(line for line in lines if '"error"' in line)[:300]
        else:
            reply = http.post(f"{URL}/v1/chat/completions", json=body)
            asked.status = reply.status_code
            if reply.status_code != 200 or "choices" not in reply.json():
                asked.error = reply.text[:300]
    except (httpx.HTTPError, ValueError) as err:
        asked.error = repr(err)[:300]
    asked.ended = time.monotonic()
    return asked


def client(n: int, seed: int, until: float, soak: Soak, session: tuple[int, int] = (1, 1)) -> None:
    """One request after another until ``until``; the last one is read to its end.

    Each session of ``session`` requests (drawn in LOW-HIGH) asks for one model, drawn 5:4:1; with
    (1, 1) every request draws its model (and the draws are those of a soak without sessions); with
    (0, 0) the client asks for one model all along (DEDICATED: three the resident's, two the default
    engine's, one the second profile's).
    """
    rng = random.Random(seed * 100 + n)
    left, model = 0, MODELS[DEDICATED[n % len(DEDICATED)]]
    with httpx.Client(timeout=httpx.Timeout(1200.0, connect=30.0), trust_env=False) as http:
        while time.monotonic() < until:
            if session == (1, 1):
                model = rng.choices(MODELS, WEIGHTS)[0]
            elif session != (0, 0) and left == 0:
                model, left = rng.choices(MODELS, WEIGHTS)[0], rng.randint(*session)
            left = max(0, left - 1)
            soak.asked.append(ask(http, model, rng.random() < 0.5))


def arrivals(seed: int, seconds: float, rate: float) -> list[tuple[float, str, bool]]:
    """The open loop's requests: (seconds since the start, model, streamed), a Poisson stream at ``rate``
    per second, models drawn 5:4:1, half streamed; the same for every policy."""
    rng = random.Random(seed * 1000 + 7)
    out, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return out
        out.append((at, rng.choices(MODELS, WEIGHTS)[0], rng.random() < 0.5))


def open_loop(schedule: list[tuple[float, str, bool]], started: float, soak: Soak) -> None:
    """Send each request at its time, whatever became of those before it (each on a thread of its own)."""
    lock = threading.Lock()

    def one(http: httpx.Client, model: str, stream: bool) -> None:
        asked = ask(http, model, stream)
        with lock:
            soak.asked.append(asked)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=CLIENTS)
    with httpx.Client(timeout=httpx.Timeout(1200.0, connect=30.0), limits=limits, trust_env=False) as http:
        threads = []
        for at, model, stream in schedule:
            time.sleep(max(0.0, started + at - time.monotonic()))
            t = threading.Thread(target=one, args=(http, model, stream))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()


def do(stack: Stack, kind: str) -> str:
    """Kill gpuswapd's or the gateway's main process with SIGKILL, or the engine that runs."""
    if kind in ("gpuswapd", "gateway"):
        unit = "gpuswapd.service" if kind == "gpuswapd" else "gpuswapd-gateway.service"
        killed = stack.manager("KillUnit", "ssi", unit, "main", "9", check=False)
        return "killed" if killed is not None else "not running"
    running = stack.docker("ps", "--format", "{{.Names}}").stdout.split()
    for name in running:
        if name in ENGINES:
            return "killed" if stack.docker("kill", name).returncode == 0 else f"{name}: kill failed"
    return "no engine"


def chaos(stack: Stack, schedule: list[tuple[float, str]], started: float, stop: threading.Event,
          soak: Soak) -> None:
    for at, kind in schedule:
        if stop.wait(max(0.0, started + at - time.monotonic())):
            return
        soak.chaos.append(Chaos(time.monotonic(), kind, do(stack, kind)))


# -- one policy's daemons --------------------------------------------------------------------------


def old_code(stack: Stack, rev: str) -> Path:
    """``git archive REV gpuswapd``, in the world's directory (readable by the gateway's dynamic user)."""
    code = stack.paths.root / "soak" / f"code-{rev}"
    if not (code / "gpuswapd" / "daemon.py").exists():
        shutil.rmtree(code, ignore_errors=True)
        code.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "gpuswapd"], check=True,
                                 capture_output=True, timeout=60)
        subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True, timeout=60)
    return code


def install(stack: Stack, policy: str, config: Path, code: Path | None) -> None:
    """Install the shipped gpuswapd and gateway units in the world, running ``code`` (None: this checkout)."""
    subprocess.run(["systemd-sysusers", str(REPO / "units" / "sysusers.d" / "gpuswapd.conf")], check=True,
                   capture_output=True, timeout=60)
    env, logs = stack.env(), stack.paths.logs
    site = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
    start = (f"{BIN}/gpuswapd --config {config}" if code is None else
             f"{BIN}/python -c \"import sys; from gpuswapd.daemon import main; sys.exit(main())\" --config {config}")
    stack.install_unit("gpuswapd.socket", (REPO / "units" / "gpuswapd.socket").read_text(),
                       {"test-world.conf": "[Unit]\nDefaultDependencies=no\n"})
    stack.install_unit("gpuswapd.service", (REPO / "units" / "gpuswapd.service").read_text(), {
        "test-world.conf": (
            f"[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\nExecStart={start}\n"
            f"Environment=DOCKER_HOST={env['DOCKER_HOST']} PATH={env['PATH']}\n"
            + (f"Environment=PYTHONPATH={code}\n" if code is not None else "")
            + f"BindPaths={stack.paths.root}\nBindReadOnlyPaths={REPO}\n"
            f"StandardOutput=append:{logs}/soak-{policy}-gpuswapd.log\nStandardError=inherit\n")})
    stack.install_unit("gpuswapd-gateway.socket", (REPO / "units" / "gpuswapd-gateway.socket").read_text(),
                       {"test-world.conf": "[Unit]\nDefaultDependencies=no\n"})
    stack.install_unit("gpuswapd-gateway.service", (REPO / "units" / "gpuswapd-gateway.service").read_text(), {
        "test-world.conf": (
            "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\n"
            f"ExecStart={SYSTEM_PYTHON} -m gpuswapd.gateway.main --config {config} --socket {SOCKET}\n"
            f"Environment=PYTHONPATH={code or REPO}:{site} PYTHONUNBUFFERED=1\n"
            f"BindReadOnlyPaths={stack.paths.root} {REPO}\n"
            f"StandardOutput=append:{logs}/soak-{policy}-gateway.log\nStandardError=inherit\n")})


def ctl(stack: Stack, *args: str) -> Any:
    out = subprocess.run([str(BIN / "gpuswapctl"), "--socket", str(stack.paths.run / "gpuswapd" / "gpuswapd.sock"),
                          *args, "--json"], env={**os.environ, **stack.env()}, capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise StackError(f"gpuswapctl {' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def boots(stack: Stack) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((stack.paths.gpu / "engine-boots").read_text() or 0)
    return 0


def stop(stack: Stack, probe: Probe, unit: str, timeout: float = 700) -> str:
    stack.manager("StopUnit", "ss", unit, "replace", check=False)
    deadline = time.monotonic() + timeout
    while (state := probe.active_state(unit)) not in ("inactive", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
    return state


def soak_once(stack: Stack, policy: str, code: Path | None, seconds: float, schedule: list[tuple[float, str]],
              boot_delay: float | None, seed: int, session: tuple[int, int] = (1, 1),
              rate: float | None = None) -> Soak:
    """Run one policy's soak on a world at its baseline; leave it at its baseline again."""
    probe = Probe(stack)
    stack.reset()
    marks = stack.paths.run / "gpuswapd"
    if marks.is_dir():  # the records of an earlier soak's gpuswapd, if it left any: not this one's
        for f in marks.iterdir():
            if f.is_file():
                f.unlink()
    env = engine_env(boot_delay)
    profiles = profile_sections(stack)
    profiles["profiles__eval__container"]["env"]["ENGINE_BOOT_DELAY"] = env["ENGINE_BOOT_DELAY"]
    profiles["profiles__eval"]["serves"] = ["qwen-eval"]
    sections = gateway_sections(idle=None, hold=None)
    shutil.rmtree(stack.paths.root / "gpuswapd" / f"soak-{policy}", ignore_errors=True)
    config = stack_config(stack, f"soak-{policy}", **profiles, **sections, daemon={"socket_group": None},
                          window__container={"env": env})
    install(stack, policy, config, code)
    soak = Soak(policy)
    try:
        for unit in ("gpuswapd.socket", "gpuswapd-gateway.socket"):
            stack.manager("StartUnit", "ss", unit, "replace")
        deadline = time.monotonic() + 120
        while True:  # the first connection starts the gateway, and its first call gpuswapd
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(f"{URL}/health", timeout=5, trust_env=False).json().get("gpuswapd"):
                    break
            if time.monotonic() > deadline:
                raise StackError(f"the {policy} gateway did not answer with gpuswapd behind it within 120 s; "
                                 f"see {stack.paths.logs}/soak-{policy}-*.log")
            time.sleep(0.2)
        boots_before, wall = boots(stack), time.time()
        started = time.monotonic()
        halt = threading.Event()
        if rate is None:
            threads = [threading.Thread(target=client, args=(n, seed, started + seconds, soak, session))
                       for n in range(CLIENTS)]
        else:
            threads = [threading.Thread(target=open_loop, args=(arrivals(seed, seconds, rate), started, soak))]
        threads.append(threading.Thread(target=chaos, args=(stack, schedule, started, halt, soak)))
        for t in threads:
            t.start()
        for t in threads[:-1]:
            t.join()
        halt.set()
        threads[-1].join()
        history = ctl(stack, "history", "--limit", "1000")["windows"]
        opened = [w for w in history if (w.get("opened_at") or 0) >= wall]
        soak.windows = len(opened)
        for w in opened:  # what ended each: its leases' end, an engine's death, a kill...
            key = f"{w.get('profile')}: {w.get('outcome')}{' (switched)' if w.get('switched_to') else ''}"
            soak.outcomes[key] = soak.outcomes.get(key, 0) + 1
        soak.boots = boots(stack) - boots_before
    finally:
        for unit in ("gpuswapd-gateway.socket", "gpuswapd-gateway.service", "gpuswapd.service", "gpuswapd.socket"):
            stop(stack, probe, unit)
        soak.back = probe.states([*RESIDENT_UNITS, *AGENT_TIMERS, OTHER_TIMER])
        soak.leftovers = [c["Names"] for c in probe.containers()]
    return soak


# -- the run ---------------------------------------------------------------------------------------


def summary(soak: Soak, seconds: float) -> dict[str, Any]:
    split = classify(soak.asked, soak.chaos)
    took = [a.ended - a.sent for a in split["ok"]]
    return {
        "windows": soak.windows, "window_outcomes": dict(sorted(soak.outcomes.items())),
        "engine_boots": soak.boots, "sent": len(soak.asked), "answered": len(split["ok"]),
        "answered_per_min": round(len(split["ok"]) / (seconds / 60), 1),
        "latency_s": {"p50": round(quantile(took, 0.5), 2), "p90": round(quantile(took, 0.9), 2),
                      "max": round(max(took), 2)} if took else {},
        "per_model": {m: sum(1 for a in split["ok"] if a.model == m) for m in MODELS},
        "429": len(split["429"]), "through_killed_gateway": len(split["gateway_killed"]),
        "failed": len(split["failed"]),
        "failures": [asdict(a) for a in split["failed"]][:20],
        "chaos": {k: sum(1 for c in soak.chaos if c.kind == k and c.done == "killed")
                  for k in ("gpuswapd", "gateway", "engine")},
        "back": soak.back, "leftover_containers": soak.leftovers,
    }


def run(cycles: int, policies: list[str], rev: str, seconds: float, every: tuple[float, float], seed: int,
        lag: float | None, boot_delay: float | None, session: tuple[int, int] = (1, 1),
        rate: float | None = None) -> dict[str, Any]:
    stack = world(lag)
    out: dict[str, Any] = {"seconds": seconds, "every": every, "seed": seed, "old": rev, "session": session,
                           "arrivals_per_s": rate, "cycles": []}
    with stack.exclusive():
        stack.up()
        os.environ.update(stack.env())
        code = old_code(stack, rev) if "old" in policies else None
        schedule = draws(seed, seconds, every)
        try:
            for n in range(cycles):
                cycle = {}
                for policy in policies:
                    soak = soak_once(stack, policy, code if policy == "old" else None, seconds, schedule,
                                     boot_delay, seed + n, session, rate)
                    cycle[policy] = summary(soak, seconds)
                    print_policy(policy, cycle[policy])
                out["cycles"].append(cycle)
        finally:
            stack.reset()
    return out


def print_policy(policy: str, s: dict[str, Any]) -> None:
    lat = s["latency_s"]
    print(table(f"soak, {policy}: {s['chaos']['gpuswapd']} gpuswapd kills, {s['chaos']['gateway']} gateway kills, "
                f"{s['chaos']['engine']} engine deaths",
                ("windows", "boots", "sent", "answered", "/min", "p50 s", "p90 s", "max s", "429",
                 "cut by a gateway kill", "failed"),
                [(s["windows"], s["engine_boots"], s["sent"], s["answered"], s["answered_per_min"], lat.get("p50"),
                  lat.get("p90"), lat.get("max"), s["429"], s["through_killed_gateway"], s["failed"])]))
    print("  windows by how they ended: " + (", ".join(f"{k} {n}" for k, n in s["window_outcomes"].items()) or "none"))
    for f in s["failures"][:5]:
        print(f"  failed: {f['model']} stream={f['stream']} status={f['status']} {f['error'][:160]}")
    down = {u: v for u, v in s["back"].items() if v != "active"}
    print(f"  after both daemons stopped: {'resident and timers back' if not down else f'NOT back: {down}'}"
          f"{'; containers left: ' + ', '.join(s['leftover_containers']) if s['leftover_containers'] else ''}")
    sys.stdout.flush()


def _every(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split("-"))
    except ValueError:
        raise SystemExit(f"soak_bench: --every {text!r}: give LOW-HIGH seconds, e.g. 20-60") from None
    if not 0 < lo <= hi <= 3600:
        raise SystemExit(f"soak_bench: --every {text!r}: need 0 < LOW <= HIGH <= 3600")
    return lo, hi


def _session(text: str) -> tuple[int, int]:
    if text == "0":
        return 0, 0
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise SystemExit(f"soak_bench: --session {text!r}: give LOW-HIGH requests, e.g. 5-15, or 0") from None
    if not 1 <= lo <= hi <= 10_000:
        raise SystemExit(f"soak_bench: --session {text!r}: need 1 <= LOW <= HIGH <= 10000")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = parser("soak_bench", __doc__, "each cycle soaks each policy once, one after the other")
    add_world_options(p)
    p.add_argument("--minutes", type=float, default=10.0, help="each soak's length (default 10)")
    p.add_argument("--policies", default="old,new", help="which, in this order: old, new or both (default old,new)")
    p.add_argument("--old", default=OLD, help=f"the old policy's revision (default {OLD}: no schedule)")
    p.add_argument("--every", default="20-60", help="seconds between two troubles, drawn in LOW-HIGH (default 20-60)")
    p.add_argument("--seed", type=int, default=37, help="the draws of troubles and of clients (default 37)")
    p.add_argument("--session", default="1-1",
                   help="requests a client sends for one model before it draws the next, LOW-HIGH (default 1-1: "
                        "a model drawn for every request), or 0: each client keeps one model (3:2:1)")
    p.add_argument("--arrivals", type=float, default=None, metavar="RATE",
                   help="an open loop instead of the six clients: requests at RATE per second (Poisson), each "
                        "sent at its time whatever became of the others: the same requests for each policy")
    args = p.parse_args(argv)
    if args.arrivals is not None and not 0 < args.arrivals <= 50:
        p.error("--arrivals must be more than 0 and at most 50 requests a second")
    policies = [x for x in args.policies.split(",") if x]
    if not policies or set(policies) - {"old", "new"}:
        p.error(f"--policies {args.policies!r}: old, new or old,new")
    if not 0 < args.minutes <= 120:
        p.error("--minutes must be more than 0 and at most 120")
    result = run(args.cycles, policies, args.old, args.minutes * 60, _every(args.every), args.seed, args.lag,
                 args.boot_delay, _session(args.session), args.arrivals)
    path = write_results("soak", result)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
