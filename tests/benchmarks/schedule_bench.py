"""Swap only when it pays: the gateway's schedule (this checkout) against the old one, side by side.

    .venv/bin/python -m tests.benchmarks.schedule_bench [--cycles 1] [--minutes 4] [--boot 30] [--back 5]
                                                       [--workloads agent,alternate,burst] [--old REV] [--factor 4]
                                                       [--hold 900]

No test world is needed: each policy gets its own stand-in of gpuswapd that models one card
with a price (a window's move to an engine costs ``--boot`` seconds, the resident's return
``--back`` seconds, one move at a time, acquires granted in the order they came, the resident
drained through the gateway's own ``/gpuswapd/in-flight?draining=1`` before it stops, a window
closed when its last lease ends), its own model servers (each answers a request in a fixed
service time, 2 s) and its own gateway: the real ``gpuswapd-gateway`` of this checkout ("new"),
and the gateway of ``--old`` ("old": by default bcfa671, the last gateway without a schedule,
``git archive REV gpuswapd`` run from a folder of its own).
Both run at once on the same workload, started together, so that the machine's load falls on
both alike; the workloads run one after another, each on fresh processes.

The workloads (the issue's three, shortened to ``--minutes`` each; the price is not shortened):

1. ``agent``: an agent on the resident (a request a second, 2 s each) and one engine user (a
   request every 10 s);
2. ``alternate``: two engine models, each requested by its own user, one request after another;
3. ``burst``: the agent, and a burst of 40 engine requests 10 s in;
4. ``soak``: 6 clients, one request after another, for the resident, the default engine and a
   second profile in 5:4:1, while the stand-in gpuswapd drops every connection (as a kill -9 of
   a socket-activated gpuswapd does; its window is kept for 2 s for its holders to come back)
   every 20-60 s.

Per workload and policy: the card's moves (swaps) and the time it spent moving, requests
answered per minute per tenant, the wait per tenant (a request's time less its service time)
as n, p50, p99, max, and the requests that failed (any answer but 200).

What bounds the result: the card's price is the stand-in's constants (``--boot``, ``--back``),
not a real engine's; the model servers answer in a fixed time; gpuswapd's own queue is the
stand-in's first-come order (the schedule of gpuswapd's queue is not measured here, only the
gateway's side: its batching, its residency bound, its lease given back); ``gateway.hold`` and
``gateway.idle`` are the defaults (15 and 5 min; ``--hold``), so no wait can exceed 15 min and the residency
is ``--factor`` x the price of the two swaps (at 6: 210 s at this price, under its cap of
hold / 4); a run shorter than a few residencies shows few moves of either policy.

Results: tables on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.benchmarks.report import parser, write_results

REPO = Path(__file__).resolve().parents[2]
SERVICE_S = 2.0
HOLD_S = 900.0  # gateway.hold, its default (--hold)
WORKLOADS = ("agent", "alternate", "burst", "soak")
OLD = "bcfa671"  # the last gateway without a schedule (its merge is ff67a66's first parent)
RECLAIM_S = 2.0  # after a restart the stand-in keeps an adopted window this long for its holders to come back
MODELS = {"resident": "strata", "default": "hyperqwen", "eval": "qwen-eval"}
CONFIG = """
[resident]
units = ["strata.service"]
[resident.verify]
url = "http://127.0.0.1:{resident}/v1/chat/completions"
model = "strata"
[window]
health_url = "http://127.0.0.1:{default}/health"
serves = ["hyperqwen"]
[window.container]
name = "hyperqwen"
image = "hyperqwen:latest"
[window.verify]
url = "http://127.0.0.1:{default}/v1/chat/completions"
model = "hyperqwen"
[profiles.eval]
kind = "engine"
health_url = "http://127.0.0.1:{eval}/health"
serves = ["qwen-eval"]
api = "http://127.0.0.1:{eval}/v1"
[profiles.eval.container]
name = "qwen-eval"
image = "qwen-eval:latest"
[profiles.eval.verify]
url = "http://127.0.0.1:{eval}/v1/chat/completions"
model = "qwen-eval"
[gateway]
listen = "127.0.0.1:{gateway}"
resident = "http://127.0.0.1:{resident}"
idle = "5m"
hold = "{hold:g}s"
max_waiting = 1024
"""


# -- the stand-ins ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Waiter:
    profile: str
    granted: asyncio.Future[dict[str, Any]]


@dataclass
class Card:
    """gpuswapd on one card, with a price: one tenant at a time, moved in the order acquires came."""

    boot_s: float
    back_s: float
    gateway_port: int
    factor: float = 6.0  # daemon.residency_factor, as gpuswapd's status tells it
    tenant: str = "resident"
    phase: str = "IDLE"
    leases: dict[str, str] = field(default_factory=dict)  # lease id: profile
    queue: list[Waiter] = field(default_factory=list)
    watchers: list[asyncio.StreamWriter] = field(default_factory=list)
    swaps: int = 0
    moving_s: float = 0.0
    made: int = 0
    restarts: int = 0
    took: dict[str, float] = field(default_factory=dict)  # tenant: seconds its last move took
    adopted_until: float = 0.0

    def __post_init__(self) -> None:
        self.wake = asyncio.Event()
        self.connections: set[asyncio.StreamWriter] = set()

    def restart(self) -> None:
        """Drop every connection, as gpuswapd killed with -9 does (its socket unit keeps the socket)."""
        self.restarts += 1
        self.adopted_until = time.monotonic() + RECLAIM_S
        for writer in list(self.connections):
            writer.transport.abort()

    def emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        for w in list(self.watchers):
            with contextlib.suppress(Exception):
                w.write(line)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.emit({"event": "phase_entered", "phase": phase})

    def status(self) -> dict[str, Any]:
        window = None if self.tenant == "resident" and self.phase == "IDLE" else {
            "profile": self.tenant, "phase": self.phase, "timings": [],
            "leases": [{"id": i, "holder": "gateway", "expires_at": time.time() + 3600} for i in self.leases]}
        # The price of each swap, as gpuswapd's history has it (once the card has moved there).
        price = {p: {"open_s": s, "resident_restart_s": self.took.get("resident")}
                 for p, s in self.took.items() if p != "resident"}
        return {"ok": True, "phase": self.phase, "window": window, "price": price,
                "schedule": {"residency_factor": self.factor, "residency_max_s": 900.0},
                "resident_back": {"in_s": self.back_s, "close_s": self.back_s} if window else None}

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.phase == "READY":
                for w in [w for w in self.queue if w.profile == self.tenant]:
                    self.queue.remove(w)
                    if not w.granted.done():
                        self.made += 1
                        lease = f"lease-{self.made}"
                        self.leases[lease] = w.profile
                        w.granted.set_result({"id": lease, "holder": "gateway", "expires_at": time.time() + 3600})
            if self.leases:
                continue
            if time.monotonic() < self.adopted_until:  # an adopted window: its holders may come back
                await asyncio.sleep(self.adopted_until - time.monotonic())
                self.wake.set()
                continue
            if self.queue:
                await self.move(self.queue[0].profile)
                self.wake.set()
            elif self.tenant != "resident":
                await self.move("resident")
                self.wake.set()

    async def move(self, to: str) -> None:
        if self.tenant == "resident":
            self.set_phase("DRAINING")
            async with httpx.AsyncClient(trust_env=False) as http:
                while True:  # the resident's requests in flight end first (the gateway holds new ones)
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        got = await http.get(f"http://127.0.0.1:{self.gateway_port}/gpuswapd/in-flight?draining=1")
                        if got.json().get("resident_in_flight") == 0:
                            break
                    await asyncio.sleep(0.2)
            self.set_phase("STOPPING_RESIDENT")
        started = time.monotonic()
        if to == "resident":
            self.set_phase("RESTORING")
            await asyncio.sleep(self.back_s)
            self.tenant, self.phase = "resident", "IDLE"
            self.emit({"event": "window_finished", "outcome": "closed"})
        else:
            self.set_phase("BOOTING")
            await asyncio.sleep(self.boot_s)
            self.tenant = to
            self.set_phase("READY")
        self.swaps += 1
        self.took[to] = time.monotonic() - started
        self.moving_s += self.took[to]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # CancelledError: the run is over and its connections are dropped (nothing to say).
        self.connections.add(writer)
        with contextlib.suppress(ConnectionError, ValueError, asyncio.IncompleteReadError, asyncio.CancelledError):
            request = json.loads(await reader.readline())
            op = request.get("op")
            if op == "watch":
                writer.write(b'{"event": "subscribed"}\n')
                self.watchers.append(writer)
                while await reader.read(4096):
                    pass
                self.watchers.remove(writer)
            elif op == "status":
                writer.write(json.dumps(self.status()).encode() + b"\n")
            elif op == "acquire":
                await self.acquire(str(request.get("profile") or "default"), reader, writer)
            elif op == "release":
                lease = request.get("lease")
                if lease is not None and self.leases.pop(str(lease), None) is not None:
                    self.wake.set()
                writer.write(b'{"ok": true, "released": []}\n')
            else:  # renew
                writer.write(json.dumps({"ok": True, "lease": {"id": request.get("lease"),
                                                               "expires_at": time.time() + 3600}}).encode() + b"\n")
            await writer.drain()
        self.connections.discard(writer)
        writer.close()

    async def acquire(self, profile: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        waiter = Waiter(profile, asyncio.get_running_loop().create_future())
        self.queue.append(waiter)
        self.wake.set()
        writer.write(json.dumps({"event": "queued", "position": len(self.queue)}).encode() + b"\n")
        hangup = asyncio.ensure_future(reader.read())
        await asyncio.wait({waiter.granted, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.granted.done():  # withdrawn
            waiter.granted.cancel()
            with contextlib.suppress(ValueError):
                self.queue.remove(waiter)
            self.wake.set()
            return
        lease = waiter.granted.result()
        writer.write(json.dumps({"ok": True, "lease": lease}).encode() + b"\n")
        await writer.drain()
        await hangup  # bound to the connection
        if self.leases.pop(lease["id"], None) is not None:
            self.wake.set()


async def model_server(model: str) -> tuple[asyncio.Server, int]:
    """A model server that answers each completion after SERVICE_S (Connection: close)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ValueError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length:")), 0)
            await reader.readexactly(length)
            if lines[0].startswith("GET"):
                body = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()
            else:
                await asyncio.sleep(SERVICE_S)
                body = json.dumps({"model": model, "choices": [{"message": {"content": "ok"}}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


# -- one policy's setup ----------------------------------------------------------------------------


@dataclass
class Rig:
    policy: str
    card: Card
    port: int
    proc: subprocess.Popen[bytes]
    servers: list[asyncio.Server]
    results: list[dict[str, Any]] = field(default_factory=list)


async def start_rig(policy: str, root: Path, old_code: Path, boot_s: float, back_s: float, factor: float,
                    hold_s: float) -> Rig:
    servers, ports = [], {}
    for tenant, model in MODELS.items():
        server, ports[tenant] = await model_server(model)
        servers.append(server)
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        ports["gateway"] = int(s.getsockname()[1])
    card = Card(boot_s, back_s, ports["gateway"], factor)
    sock = root / f"{policy}.sock"
    servers.append(await asyncio.start_unix_server(card.handle, str(sock)))
    config = root / f"{policy}.toml"
    config.write_text(CONFIG.format(hold=hold_s, **ports))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if policy == "old":
        env["PYTHONPATH"] = str(old_code)
    log = open(root / f"gateway-{policy}.log", "ab")  # noqa: SIM115, ASYNC230 - handed to the child, at setup
    with log:
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
            [sys.executable, "-m", "gpuswapd.gateway.main", "--config", str(config),
                                 "--socket", str(sock), "--log-level", "warning"],
                                cwd=str(old_code if policy == "old" else REPO), env=env,
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    rig = Rig(policy, card, ports["gateway"], proc, servers)
    spawned = asyncio.ensure_future(card.run())
    servers[-1]._bench_card_task = spawned  # type: ignore[attr-defined]  # kept alive with the server
    async with httpx.AsyncClient(trust_env=False) as http:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"http://127.0.0.1:{rig.port}/health")).status_code == 200:
                    return rig
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the {policy} gateway did not answer; see {root}/gateway-{policy}.log")


async def stop_rig(rig: Rig) -> None:
    rig.proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        rig.proc.wait(30)
    if rig.proc.poll() is None:
        rig.proc.kill()
    for server in rig.servers:
        server.close()
        with contextlib.suppress(Exception):
            getattr(server, "_bench_card_task", None) and server._bench_card_task.cancel()  # type: ignore[attr-defined]


# -- the workloads ---------------------------------------------------------------------------------


async def one(http: httpx.AsyncClient, rig: Rig, tenant: str) -> None:
    started = time.monotonic()
    body = {"model": MODELS[tenant], "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    try:
        reply = await http.post(f"http://127.0.0.1:{rig.port}/v1/chat/completions", json=body)
        status = reply.status_code
    except httpx.HTTPError as err:
        status = repr(err)  # type: ignore[assignment]
    took = time.monotonic() - started
    rig.results.append({"tenant": tenant, "status": status, "at": started, "took": took,
                        "wait": max(0.0, took - SERVICE_S)})


async def every(seconds: float, until: float, make: Callable[[], Awaitable[None]], tasks: list[Any]) -> None:
    while time.monotonic() < until:
        tasks.append(asyncio.ensure_future(make()))
        await asyncio.sleep(seconds)


async def closed_loop(until: float, make: Callable[[], Awaitable[None]]) -> None:
    while time.monotonic() < until:
        await make()


async def workload(name: str, rig: Rig, seconds: float, hold_s: float) -> None:
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(trust_env=False, timeout=hold_s + 120, limits=limits) as http:
        until = time.monotonic() + seconds
        tasks: list[Any] = []
        if name == "agent":
            await asyncio.gather(every(1.0, until, lambda: one(http, rig, "resident"), tasks),
                                 every(10.0, until, lambda: one(http, rig, "default"), tasks))
        elif name == "alternate":
            await asyncio.gather(closed_loop(until, lambda: one(http, rig, "default")),
                                 closed_loop(until, lambda: one(http, rig, "eval")))
        elif name == "soak":
            async def restarts() -> None:
                draw = random.Random(37)
                while time.monotonic() < until:
                    await asyncio.sleep(draw.uniform(20, 60))
                    rig.card.restart()

            async def client(n: int) -> None:
                draw = random.Random(n)
                while time.monotonic() < until:
                    await one(http, rig, draw.choices(("resident", "default", "eval"), (5, 4, 1))[0])
            await asyncio.gather(restarts(), *(client(n) for n in range(6)))
        else:
            async def burst() -> None:
                await asyncio.sleep(10)
                tasks.extend(asyncio.ensure_future(one(http, rig, "default")) for _ in range(40))
            await asyncio.gather(every(1.0, until, lambda: one(http, rig, "resident"), tasks), burst())
        await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(rig: Rig, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"swaps": rig.card.swaps, "moving_s": round(rig.card.moving_s, 1),
                           "restarts": rig.card.restarts, "tenants": {}}
    for tenant in MODELS:
        mine = [r for r in rig.results if r["tenant"] == tenant]
        if not mine:
            continue
        ok = [r for r in mine if r["status"] == 200]
        waits = [r["wait"] for r in ok]
        out["tenants"][tenant] = {"n": len(mine), "ok": len(ok), "failed": len(mine) - len(ok),
                                  "per_min": round(len(ok) / (seconds / 60), 1),
                                  "wait_p50": round(pct(waits, 0.5), 1), "wait_p99": round(pct(waits, 0.99), 1),
                                  "wait_max": round(max(waits, default=float("nan")), 1),
                                  "errors": sorted({str(r["status"]) for r in mine if r["status"] != 200})[:3]}
    return out


async def run(names: list[str], seconds: float, boot_s: float, back_s: float, old: str,
              factor: float, hold_s: float = HOLD_S) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="schedule-bench-", dir="/var/tmp"))
    old_code = root / "old"
    old_code.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", old, "gpuswapd"],  # noqa: ASYNC221 - setup
                             check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(old_code)], input=archive.stdout, check=True)  # noqa: ASYNC221
    results: dict[str, Any] = {"seconds": seconds, "boot_s": boot_s, "back_s": back_s, "old": old,
                               "residency_factor": factor, "hold_s": hold_s, "workloads": {}}
    for name in names:
        rigs: list[Rig] = []
        try:
            for policy in ("old", "new"):
                rigs.append(await start_rig(policy, root, old_code, boot_s, back_s, factor, hold_s))
            await asyncio.gather(*(workload(name, rig, seconds, hold_s) for rig in rigs))
        finally:
            for rig in rigs:
                await stop_rig(rig)
        results["workloads"][name] = {rig.policy: summary(rig, seconds) for rig in rigs}
        print_workload(name, results["workloads"][name])
    return results


def print_workload(name: str, figures: dict[str, Any]) -> None:
    print(f"\n== {name} ==  " + "  ".join(f"{p}: {f['swaps']} swaps, {f['restarts']} gpuswapd restarts"
                                         for p, f in figures.items()))
    print(f"{'policy':6} {'swaps':>5} {'moving_s':>8}  {'tenant':9} {'n':>4} {'ok':>4} {'fail':>4} {'per_min':>7} "
          f"{'wait_p50':>8} {'wait_p99':>8} {'wait_max':>8}")
    for policy, f in figures.items():
        for tenant, t in f["tenants"].items():
            print(f"{policy:6} {f['swaps']:>5} {f['moving_s']:>8}  {tenant:9} {t['n']:>4} {t['ok']:>4} "
                  f"{t['failed']:>4} {t['per_min']:>7} {t['wait_p50']:>8} {t['wait_p99']:>8} {t['wait_max']:>8}  "
                  f"{' '.join(t['errors'])}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = parser("schedule_bench", __doc__, "each cycle runs every workload once, both policies side by side")
    p.add_argument("--minutes", type=float, default=4.0, help="each workload's length (default 4)")
    p.add_argument("--boot", type=float, default=30.0, help="seconds a window's move to an engine costs (default 30)")
    p.add_argument("--back", type=float, default=5.0, help="seconds the resident's return costs (default 5)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="which, comma-separated (default all)")
    p.add_argument("--factor", type=float, default=6.0,
                   help="gpuswapd's daemon.residency_factor, which the new gateway follows (default 6, its default)")
    p.add_argument("--hold", type=float, default=HOLD_S,
                   help="gateway.hold in seconds for both gateways (default 900, its default)")
    p.add_argument("--old", default=OLD, help=f"the old policy's revision (default {OLD}: no schedule)")
    args = p.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads: {', '.join(sorted(unknown))} (known: {', '.join(WORKLOADS)})")
    cycles = [asyncio.run(run(names, args.minutes * 60, args.boot, args.back, args.old, args.factor, args.hold))
              for _ in range(args.cycles)]
    path = write_results("schedule", {"cycles": cycles})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
