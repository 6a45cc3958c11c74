"""The gateway on fakes: routing, bad input, and the on-demand logic against a fake gpuswapd.

The real behaviour (uvicorn, gpuswapd, systemd, the engine in Docker, the official openai client)
is in tests/integration/test_gateway.py; here the ASGI app runs in-process (httpx's ASGITransport)
with httpx.MockTransport as the upstreams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from gpuswapd import clock
from gpuswapd.config import parse_config
from gpuswapd.errors import EngineFailed, LeaseNotFound, ResidentBusy
from gpuswapd.gateway import demand as demand_module
from gpuswapd.gateway import routes
from gpuswapd.gateway.app import Gateway
from gpuswapd.gateway.demand import Demand
from gpuswapd.gateway.errors import BadBody
from gpuswapd.gateway.follow import Follow
from gpuswapd.gateway.link import LinkDown
from gpuswapd.gateway.meters import Meters
from gpuswapd.gateway.tenants import Tenants
from gpuswapd.gateway.upstream import Upstream

CONFIG = """
[resident]
units = ["strata.service"]
[resident.verify]
url = "http://127.0.0.1:8090/v1/chat/completions"
model = "strata"
[window]
health_url = "http://127.0.0.1:18020/health"
serves = ["hyperqwen"]
[window.container]
name = "hyperqwen"
image = "hyperqwen:latest"
[window.verify]
url = "http://127.0.0.1:18020/v1/chat/completions"
model = "hyperqwen"
[profiles.eval]
kind = "engine"
health_url = "http://127.0.0.1:18021/health"
serves = ["qwen-eval"]
api = "http://127.0.0.1:18021/v1"
[profiles.eval.container]
name = "qwen-eval"
image = "qwen-eval:latest"
[profiles.eval.verify]
url = "http://127.0.0.1:18021/v1/chat/completions"
model = "qwen-eval"
[gateway]
idle = "0.2s"
hold = "3s"
max_waiting = 8
max_body = "1KiB"
"""


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


class FakeHeld:
    """A connection-bound lease of the fake gpuswapd."""

    def __init__(self, daemon: FakeDaemon, lease: dict[str, Any], profile: str) -> None:
        self.daemon, self.lease, self.profile = daemon, lease, profile
        self.token: str | None = f"token-{lease['id']}"
        self.events_in: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    @property
    def id(self) -> str:
        return str(self.lease["id"])

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        while (event := await self.events_in.get()) is not None:
            yield event

    async def close(self) -> None:
        self.daemon.leases.pop(self.id, None)  # bound: the hang-up ends it
        self.events_in.put_nowait(None)


class FakeDaemon:
    """gpuswapd as the gateway sees it: acquires that open after a gate, status, renew, release."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.acquires: list[str] = []
        self.withdrawn = 0
        self.fail: Exception | None = None
        self.fails: list[Exception] = []  # the next acquires fail with these, one each
        self.leases: dict[str, dict[str, Any]] = {}
        self.others: list[dict[str, Any]] = []  # leases of other holders
        self.renew_cap: float | None = None
        self.released: list[str] = []
        self.helds: list[FakeHeld] = []
        self.phase = "IDLE"
        self.renew_fail = 0  # this many renewals fail (gpuswapd busy or away)
        self.renews = 0
        self.away = 0  # this many acquires find gpuswapd gone (a restart)
        self.reclaims: list[str | None] = []  # the token each acquire sent again
        self.cancel_lag = 0.0  # a withdrawn acquire takes this long to end (its connection closing)

    async def acquire(self, profile: str, duration: float, priority: int, holder: str | None,
                      progress: Callable[[dict[str, Any]], None], reclaim: str | None = None) -> FakeHeld:
        self.acquires.append(profile)
        self.reclaims.append(reclaim)
        progress({"event": "accepted", "token": reclaim or f"token-{len(self.acquires)}", "reclaim_s": 30})
        if self.away:
            self.away -= 1
            raise LinkDown("gpuswapd at /run/gpuswapd.sock closed the connection without a reply")
        progress({"event": "phase", "phase": "BOOTING"})
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.withdrawn += 1
            if self.cancel_lag:
                await asyncio.shield(asyncio.sleep(self.cancel_lag))
            raise
        if self.fail is not None:
            raise self.fail
        if self.fails:
            raise self.fails.pop(0)
        lease = {"id": f"lease-{len(self.acquires)}", "holder": holder, "expires_at": time.time() + duration}
        self.leases[lease["id"]] = lease
        self.phase = "READY"
        held = FakeHeld(self, lease, profile)
        self.helds.append(held)
        return held

    async def request(self, message: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
        op = message["op"]
        if op == "status":
            leases = [*self.leases.values(), *self.others]
            window = {"profile": "default", "phase": self.phase, "leases": leases, "timings": []} if leases else None
            return {"ok": True, "phase": self.phase if leases else "IDLE", "window": window,
                    "resident_back": {"at": time.time() + 42.2, "in_s": 42.2, "close_s": 3.0} if leases else None}
        if op == "renew":
            self.renews += 1
            if self.renew_fail:
                self.renew_fail -= 1
                raise LinkDown("gpuswapd did not answer renew within 15s")
            lease = self.leases.get(message["lease"])
            if lease is None:
                raise LeaseNotFound("no such lease")
            lease["expires_at"] = time.time() + min(message["for"], self.renew_cap or message["for"])
            return {"ok": True, "lease": dict(lease), "capped": self.renew_cap is not None}
        if op == "release":
            if "lease" in message:
                self.released.append(message["lease"])
                self.leases.pop(message["lease"], None)
            return {"ok": True, "released": []}
        raise AssertionError(op)


@dataclasses.dataclass
class Rig:
    app: Gateway
    daemon: FakeDaemon
    follow: Follow
    demand: Demand
    upstream_calls: list[httpx.Request]
    client: httpx.AsyncClient


Hook = Callable[[httpx.Request], Any]


def _upstream(calls: list[httpx.Request], hook: Hook | None = None) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        if hook is not None:
            await hook(request)
        if request.method == "GET" and request.url.path == "/v1/models":  # the resident's model list
            names = ["strata"]
            if request.headers.get("authorization") == "Bearer sk-llama-swap":  # llama-swap's apiKeys
                names += ["coder-7b", "coder"]  # a model added while running, and its alias
            return httpx.Response(200, json={"object": "list", "data": [{"id": n, "object": "model"} for n in names]})
        calls.append(request)
        if not request.headers.get("content-type", "").startswith("application/json"):
            said = json.dumps({"method": request.method, "url": str(request.url), "length": len(request.content)})
            return httpx.Response(200, headers={"content-type": "application/json"},
                                  stream=httpx.ByteStream(said.encode()))
        body = json.loads(request.content)
        if body.get("stream"):
            async def chunks() -> AsyncIterator[bytes]:
                for n in range(3):
                    yield f'data: {{"choices": [{{"delta": {{"content": "w{n} "}}}}], "usage": null}}\n\n'.encode()
                yield b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())
        answer = json.dumps({"model": body["model"], "host": request.url.host, "port": request.url.port}).encode()
        # stream=: as a real server's answer, read as it arrives (content= would be read already)
        return httpx.Response(200, headers={"content-type": "application/json", "content-length": str(len(answer))},
                              stream=httpx.ByteStream(answer))
    return httpx.MockTransport(handler)


@pytest.fixture(autouse=True)
def fast_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demand_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(demand_module, "WITHDRAW_GRACE_S", 0.2)


def rig(text: str = CONFIG, hook: Hook | None = None, **gateway: Any) -> Rig:
    config = parse_config(text)
    if gateway:
        config = dataclasses.replace(config, gateway=dataclasses.replace(config.gateway, **gateway))
    daemon = FakeDaemon()
    follow = Follow(daemon)  # type: ignore[arg-type]
    follow.take_status({"phase": "IDLE"})
    meters = Meters()
    demand = Demand(config.gateway, daemon, follow, meters, holder="gpuswapd-gateway[test]")
    calls: list[httpx.Request] = []
    app = Gateway(config, demand, follow, Tenants(config), Upstream(_upstream(calls, hook)), meters)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway.test")
    return Rig(app, daemon, follow, demand, calls, client)


def chat(model: str, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


# -- routing and bad input -------------------------------------------------------------------------


def test_each_model_goes_to_its_tenant() -> None:
    async def main() -> None:
        r = rig()
        resident = await r.client.post("/v1/chat/completions", json=chat("strata"))
        assert resident.status_code == 200 and resident.json()["port"] == 8090
        assert r.daemon.acquires == []  # the resident needs no window
        engine = await r.client.post("/v1/completions", json={"model": "qwen-eval", "prompt": "hi"})
        assert engine.status_code == 200 and engine.json()["port"] == 18021  # its api, /v1 taken off
        assert [str(c.url) for c in r.upstream_calls] == ["http://127.0.0.1:8090/v1/chat/completions",
                                                          "http://127.0.0.1:18021/v1/completions"]
        assert r.daemon.acquires == ["eval"]
        await r.demand.close()
    run(main())


@pytest.mark.parametrize(("body", "status", "said"), [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": []}', 400, "names no"),
    (b'{"model": 7}', 400, "names no"),
    (b'{"model": "gpt-9"}', 404, "strata, hyperqwen, qwen-eval"),
    (json.dumps({"model": "strata", "pad": "x" * 2000}).encode(), 413, "max_body"),
])
def test_bad_input_gets_a_clear_error_and_opens_no_window(body: bytes, status: int, said: str) -> None:
    async def main() -> None:
        r = rig()
        reply = await r.client.post("/v1/chat/completions", content=body)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert said in json.dumps(error) and error["type"] and error["code"]
        assert r.daemon.acquires == [] and r.upstream_calls == []
    run(main())


def test_other_paths_and_methods_go_to_llama_swap_unchanged() -> None:
    async def main() -> None:
        r = rig()
        assert (await r.client.get("/v1/chat/completions?x=1")).json()["url"] == \
            "http://127.0.0.1:8090/v1/chat/completions?x=1"
        assert (await r.client.post("/v1/rerank", json=chat("qwen-eval"))).json()["port"] == 18021
        await r.demand.close()
    run(main())


def test_models_lists_every_tenant_and_what_is_on_the_card() -> None:
    async def main() -> None:
        r = rig()
        r.app._models_read = time.monotonic()  # the resident's own list is not asked here
        listing = (await r.client.get("/v1/models")).json()
        assert [(m["id"], m["tenant"], m["on_card"]) for m in listing["data"]] == [
            ("strata", "resident", True), ("hyperqwen", "default", False), ("qwen-eval", "eval", False)]
        health = (await r.client.get("/health")).json()
        assert health["status"] == "ok" and health["phase"] == "IDLE"
        assert b"gpuswapd_gateway_waiting" in (await r.client.get("/metrics")).content
    run(main())


def test_the_resident_names_come_from_its_model_list_and_are_remembered(tmp_path: Any) -> None:
    config = parse_config(CONFIG)
    tenants = Tenants(config, str(tmp_path))
    assert tenants.learn(["strata", "coder-7b", "hyperqwen"])
    tenants.save()
    again = Tenants(config, str(tmp_path))
    assert again.route("coder-7b") is again.resident
    assert again.route("hyperqwen") is again.engines["default"]  # a profile's name stays the profile's


# -- on demand -------------------------------------------------------------------------------------


def test_concurrent_requests_open_one_window_and_its_lease_ends_idle_after_the_last() -> None:
    async def main() -> None:
        r = rig()
        r.daemon.gate.clear()
        asks = [asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen")))
                for _ in range(5)]
        await asyncio.sleep(0.2)
        assert r.daemon.acquires == ["default"] and r.demand.waiting == 5
        r.daemon.gate.set()
        assert all(reply.status_code == 200 for reply in await asyncio.gather(*asks))
        assert len(r.daemon.leases) == 1
        deadline = time.monotonic() + 3
        while r.daemon.leases:  # idle = 0.2 s after the last request ended
            assert time.monotonic() < deadline, "the idle lease was not released"
            await asyncio.sleep(0.02)
        assert r.daemon.released == ["lease-1"] and r.demand.waiting == 0
    run(main())


def test_a_streaming_request_that_waits_gets_comments_then_its_answer_with_usage() -> None:
    async def main() -> None:
        r = rig()
        r.daemon.gate.clear()
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen", stream=True)))
        await asyncio.sleep(0.3)
        r.daemon.gate.set()
        reply = await ask
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        text = reply.text
        assert text.startswith(": gpuswapd BOOTING ")
        assert text.index('"usage": {"completion_tokens": 3}') < text.index("data: [DONE]")
        await r.demand.close()
    run(main())


def test_a_failed_window_is_503_or_an_error_event_once_the_stream_started() -> None:
    async def main() -> None:
        r = rig()
        r.daemon.fail = ResidentBusy("resident strata.service is busy: 1 of 2 slots processing")
        plain = await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))
        assert plain.status_code == 503 and "is busy" in plain.json()["error"]["message"]
        r.daemon.gate.clear()
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen", stream=True)))
        await asyncio.sleep(0.2)
        r.daemon.gate.set()
        streamed = await ask
        assert streamed.status_code == 200
        event = next(line for line in streamed.text.splitlines() if line.startswith("data: "))
        assert "is busy" in json.loads(event.removeprefix("data: "))["error"]["message"]
        assert "[DONE]" not in streamed.text
    run(main())


def test_requests_waiting_on_an_engine_that_died_while_its_window_opened_ask_once_more_together() -> None:
    died = "container hyperqwen exited with code 137 while BOOTING"
    async def main() -> None:
        r = rig()
        r.daemon.fails = [EngineFailed(died)]
        r.daemon.gate.clear()
        asks = [asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen", stream=s)))
                for s in (False, True, False)]
        await asyncio.sleep(0.2)
        r.daemon.gate.set()
        replies = await asyncio.gather(*asks)
        assert [x.status_code for x in replies] == [200, 200, 200], [x.text for x in replies]
        assert "[DONE]" in replies[1].text and '"error"' not in replies[1].text
        assert r.daemon.acquires == ["default", "default"]  # one more acquire, shared by all three
        await r.demand.close()

        r = rig()
        r.daemon.fails = [EngineFailed(died), EngineFailed(died)]  # once more only: then the 503
        reply = await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))
        assert reply.status_code == 503 and "exited with code 137" in reply.json()["error"]["message"]
        assert r.daemon.acquires == ["default", "default"]
        r.daemon.fail = ResidentBusy("resident strata.service is busy")  # not the engine's: no retry
        reply = await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))
        assert reply.status_code == 503 and r.daemon.acquires == ["default", "default", "default"]
        await r.demand.close()
    run(main())


def test_hold_passes_before_the_window_opens() -> None:
    async def main() -> None:
        r = rig(hold=0.3)
        r.daemon.gate.clear()
        reply = await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))
        assert reply.status_code == 503 and "gateway.hold" in reply.json()["error"]["message"]
        await asyncio.sleep(0.05)
        assert r.daemon.withdrawn == 0  # the grace: a retry would rejoin the boot
        await asyncio.sleep(0.3)
        assert r.daemon.withdrawn == 1  # nobody waits: the acquire was withdrawn
    run(main())


def test_more_than_max_waiting_get_429_and_the_rest_are_answered() -> None:
    async def main() -> None:
        r = rig()
        r.daemon.gate.clear()
        asks = [asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen")))
                for _ in range(12)]
        await asyncio.sleep(0.3)
        r.daemon.gate.set()
        codes = sorted(reply.status_code for reply in await asyncio.gather(*asks))
        assert codes == [200] * 8 + [429] * 4 and r.daemon.acquires == ["default"]
        await r.demand.close()
    run(main())


def test_a_retry_that_comes_while_the_withdrawn_acquire_is_ending_acquires_again() -> None:
    """A client with a short timeout hangs up, its acquire is withdrawn, and its retry comes before that ends."""
    async def main() -> None:
        r = rig()
        r.daemon.gate.clear()
        r.daemon.cancel_lag = 0.2
        tenant = r.app.tenants.engines["default"]

        async def ask() -> None:
            async with r.demand.serving(tenant, demand_module_quiet):
                pass

        first = asyncio.create_task(ask())
        await asyncio.sleep(0.1)
        first.cancel()  # the client's own timeout
        await asyncio.gather(first, return_exceptions=True)
        while not r.daemon.withdrawn:
            await asyncio.sleep(0.01)
        # withdrawn, and still ending: the retry comes now
        retry = asyncio.create_task(ask())
        await asyncio.sleep(0.05)
        r.daemon.gate.set()
        await asyncio.wait_for(retry, 5)  # answered: not "withdrawn (the gateway is stopping)"
        assert r.daemon.acquires == ["default", "default"]
        await r.demand.close()
    run(main())


def test_a_waiting_client_that_goes_away_withdraws_the_acquire() -> None:
    async def main() -> None:
        r = rig()
        r.daemon.gate.clear()
        tenant = r.app.tenants.engines["default"]

        async def ask() -> None:
            async with r.demand.serving(tenant, demand_module_quiet):
                pass

        task = asyncio.create_task(ask())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert r.daemon.withdrawn == 0 and r.demand.waiting == 0  # kept for the grace
        await asyncio.sleep(0.3)
        assert r.daemon.withdrawn == 1 and not r.demand.openings
    run(main())


async def demand_module_quiet(_phase: str, _waited: float) -> None:
    return None


def test_a_resident_request_swaps_back_from_the_gateways_idle_lease() -> None:
    async def main() -> None:
        r = rig(idle=60.0)
        assert (await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))).status_code == 200
        r.follow.take({"event": "phase_entered", "phase": "READY"})
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("strata")))
        await asyncio.sleep(0.2)
        assert r.daemon.released == ["lease-1"]  # at once, not idle (60 s) later
        r.follow.take({"event": "window_finished", "outcome": "closed"})
        reply = await ask
        assert reply.status_code == 200, reply.text
    run(main())


def test_a_resident_request_while_another_holds_the_card_fails_with_retry_after() -> None:
    async def main() -> None:
        r = rig(on_resident_busy="fail")
        r.daemon.others = [{"id": "x", "holder": "train.service", "expires_at": time.time() + 40}]
        r.follow.take({"event": "phase_entered", "phase": "READY"})
        reply = await r.client.post("/v1/chat/completions", json=chat("strata"))
        assert reply.status_code == 503 and reply.headers["retry-after"] == "43"
        assert "train.service until in 40s" in reply.json()["error"]["message"]
        assert r.daemon.released == []
    run(main())


def test_a_resident_request_waits_during_a_drain_and_while_others_hold_the_card() -> None:
    async def main() -> None:
        r = rig()  # on_resident_busy = "wait"
        r.follow.mark_draining()  # gpuswapd's idle probe asked: no new resident requests
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("strata")))
        await asyncio.sleep(0.2)
        assert not ask.done() and r.upstream_calls == []
        r.daemon.others = [{"id": "x", "holder": "train.service", "expires_at": time.time() + 40}]
        r.follow.take({"event": "phase_entered", "phase": "READY"})
        await asyncio.sleep(0.2)
        assert not ask.done()
        r.follow.take({"event": "window_finished", "outcome": "closed"})
        assert (await ask).status_code == 200
    run(main())


def test_a_capped_renewal_is_taken_as_it_comes() -> None:
    async def main() -> None:
        r = rig()
        r.demand.lease_s = 0.4  # renewed when less than half is left
        r.daemon.renew_cap = 0.25
        flight_done = asyncio.Event()
        tenant = r.app.tenants.engines["default"]

        async def long_request() -> None:
            async with r.demand.serving(tenant, demand_module_quiet):
                await flight_done.wait()

        task = asyncio.create_task(long_request())
        await asyncio.sleep(0.5)
        lease = next(iter(r.demand.leases.values()))
        assert lease.expires_at <= time.time() + 0.26  # what gpuswapd granted, not what was asked
        flight_done.set()
        await task
        await r.demand.close()
    run(main())


def test_a_lease_that_max_lease_caps_below_half_the_ask_is_renewed_at_half_of_what_was_granted() -> None:
    async def main() -> None:
        r = rig()
        r.demand.lease_s = 1.0  # asked for 1 s; renewed when less than half of the granted length is left
        r.daemon.renew_cap = 0.2  # gpuswapd's max_lease: each renewal is granted 0.2 s
        done = asyncio.Event()
        task = asyncio.create_task(_hold_request(r, "default", done))
        await asyncio.sleep(1.6)  # past the first grant's end, and several capped grants
        lease = r.demand.leases.get("default")
        assert lease is not None and not lease.ending, "the lease ran out under a running request"
        assert lease.expires_at > clock.now() and r.daemon.renews >= 4
        done.set()
        await task
        await r.demand.close()
    run(main())


def test_a_preemption_stops_new_requests_then_cuts_those_in_flight() -> None:
    async def main() -> None:
        r = rig()
        tenant = r.app.tenants.engines["default"]
        started = asyncio.Event()
        flights = []

        async def in_flight() -> None:
            async with r.demand.serving(tenant, demand_module_quiet) as flight:
                flights.append(flight)
                started.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(in_flight())
        await started.wait()
        held = r.daemon.helds[0]
        held.events_in.put_nowait({"event": "preempting", "by": "urgent", "grace_s": 1})
        await asyncio.sleep(0.05)
        assert not r.demand.leases["default"].usable()  # a new request acquires again
        flights[0].on_cut = task.cancel
        held.events_in.put_nowait({"event": "preempted", "by": "urgent", "priority": 10})
        await asyncio.gather(task, return_exceptions=True)
        assert flights[0].cut is not None and "preempted by urgent" in flights[0].cut
        assert "default" not in r.demand.leases
    run(main())


def test_the_drain_probe_counts_resident_requests_in_flight() -> None:
    async def main() -> None:
        r = rig()
        tenant = r.app.tenants.resident
        async with r.demand.serving(tenant, demand_module_quiet):
            probe = (await r.client.get("/gpuswapd/in-flight")).json()
            assert probe["resident_in_flight"] == 1
            assert r.follow.resident_serves()  # a dry run (gpuswapctl plan) holds nothing
        assert (await r.client.get("/gpuswapd/in-flight?draining=1")).json()["resident_in_flight"] == 0
        assert not r.follow.resident_serves()
    run(main())


# -- leases that survive trouble, and the card moved only when it pays -----------------------------


async def _hold_request(r: Rig, profile: str, until: asyncio.Event, flights: list[Any] | None = None) -> None:
    tenant = r.app.tenants.resident if profile == "resident" else r.app.tenants.engines[profile]
    async with r.demand.serving(tenant, demand_module_quiet) as flight:
        if flights is not None:
            flights.append(flight)
        await until.wait()


def test_a_failed_renewal_is_retried_within_seconds_and_the_request_keeps_its_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demand_module, "RENEW_RETRY_S", (0.05, 0.1))

    async def main() -> None:
        r = rig()
        r.demand.lease_s = 1.0  # renewed when less than 0.5 s is left
        r.daemon.renew_fail = 3
        done = asyncio.Event()
        task = asyncio.create_task(_hold_request(r, "default", done))
        await asyncio.sleep(1.6)  # past the first grant's end
        lease = r.demand.leases.get("default")
        assert lease is not None and not lease.ending, "the lease ran out after a failed renewal"
        assert r.daemon.renews >= 4 and lease.expires_at > clock.now()  # the gateway keeps its leases on its own clock
        assert r.daemon.leases and r.app.meters.renew_failures._value.get() == 3
        done.set()
        await task
        await r.demand.close()
    run(main())


# -- every client through the front door: llama-swap's routes and names, error shapes, bounded bodies ------

RESIDENT = "http://127.0.0.1:8090"
ENGINE = "http://127.0.0.1:18021"


def _form(model: str, boundary: str = "b0undary") -> tuple[bytes, str]:
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            "Content-Type: audio/wav\r\n\r\nRIFF....model=strata\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
            f"--{boundary}--\r\n").encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_every_model_route_goes_to_the_models_tenant_and_the_rest_to_llama_swap() -> None:
    async def main() -> None:
        r = rig()
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/infill", "/completion",
                     "/v1/rerank", "/rerank", "/v1/images/generations"):
            assert (await r.client.post(path, json=chat("strata"))).json()["port"] == 8090, path
            assert (await r.client.post(path, json=chat("qwen-eval"))).json()["port"] == 18021, path
        body, kind = _form("qwen-eval")
        audio = await r.client.post("/v1/audio/transcriptions?lang=en", content=body,
                                    headers={"content-type": kind})
        assert audio.json() == {"method": "POST", "url": f"{ENGINE}/v1/audio/transcriptions?lang=en",
                                "length": len(body)}  # the form as it came, to the model's tenant
        r.upstream_calls.clear()
        for method, target in [("OPTIONS", "/v1/chat/completions"), ("GET", "/running"), ("GET", "/logs?tail=1"),
                               ("GET", "/api/events"), ("GET", "/ui/models?x=%2F"), ("DELETE", "/v1/x?y=1")]:
            reply = await r.client.request(method, target)
            assert reply.status_code == 200 and reply.json()["url"] == RESIDENT + target, (target, reply.text)
        assert [c.method for c in r.upstream_calls] == ["OPTIONS", "GET", "GET", "GET", "GET", "DELETE"]
        assert all("content-length" not in c.headers for c in r.upstream_calls[:5])  # no body made up
        # /upstream/{model}/...: the resident's to llama-swap unchanged, an engine's to the engine
        props = await r.client.get("/upstream/strata/props?a=1")
        assert props.json()["url"] == f"{RESIDENT}/upstream/strata/props?a=1"
        assert (await r.client.get("/upstream/qwen-eval/metrics")).json()["url"] == f"{ENGINE}/metrics"
        assert (await r.client.get("/upstream/gone-model/health")).json()["url"] == \
            f"{RESIDENT}/upstream/gone-model/health"  # llama-swap answers for a name it may know
        assert r.daemon.acquires == ["eval"]  # one window, opened by the engine's model
        # /unload would stop the resident behind gpuswapd's back: refused, nothing passed.
        r.upstream_calls.clear()
        unload = await r.client.post("/unload")
        assert unload.status_code == 403 and "gpuswapctl acquire" in unload.json()["error"]["message"]
        assert r.upstream_calls == []
        await r.demand.close()
    run(main())


def test_a_request_does_not_board_a_lease_that_cannot_outlive_it() -> None:
    async def main() -> None:
        r = rig()
        assert (await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))).status_code == 200
        lease = r.demand.leases["default"]
        lease.expires_at = time.time() + lease.margin / 2  # renewals failed: too little is left
        assert (await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))).status_code == 200
        assert r.daemon.acquires == ["default", "default"]  # the second took a lease of its own
        assert r.demand.leases["default"] is not lease
        await r.demand.close()
    run(main())


def test_the_lease_is_given_back_as_its_last_request_ends_while_the_gateways_request_for_another_waits() -> None:
    async def main() -> None:
        r = rig(idle=60.0, hold=20.0)
        done = asyncio.Event()
        first = asyncio.create_task(_hold_request(r, "default", done))
        await asyncio.sleep(0.1)
        other = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("qwen-eval")))
        await asyncio.sleep(0.2)
        assert r.daemon.acquires == ["default"]  # batched: default's request still runs
        assert r.demand.queue() == {"eval": 1}
        done.set()
        await first
        reply = await other
        assert reply.status_code == 200, reply.text
        assert r.daemon.released == ["lease-1"] and r.daemon.acquires == ["default", "eval"]  # at once, not idle later
        await r.demand.close()
    run(main())


def test_past_its_residency_the_card_tenant_stops_boarding_and_the_waiter_goes_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demand_module, "RESIDENCY_MIN_S", 0.4)

    async def main() -> None:
        r = rig(idle=60.0, hold=20.0)
        r.demand.price = {"default": 0.0, "eval": 0.0}  # the bound is its least, 0.4 s
        done = asyncio.Event()
        first = asyncio.create_task(_hold_request(r, "default", done))
        await asyncio.sleep(0.1)
        r.daemon.gate.clear()  # the card is default's: another window waits in gpuswapd's queue
        other = asyncio.create_task(_hold_request(r, "eval", done))
        await asyncio.sleep(0.1)
        assert r.daemon.acquires == ["default"]  # batched behind default's request
        await asyncio.sleep(0.4)
        later = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen")))
        await asyncio.sleep(0.2)
        assert r.daemon.acquires == ["default", "eval"]  # eval waited its share: its acquire went
        assert not later.done() and r.demand.queue().get("default") == 1  # a new default request does not board
        done.set()
        await asyncio.sleep(0.1)
        assert r.daemon.released == ["lease-1"]  # default's last request ended: given back at once
        r.daemon.gate.set()
        await asyncio.gather(first, other)
        assert (await later).status_code == 200
        await r.demand.close()
    run(main())


def test_a_gpuswapd_restart_does_not_fail_waiting_requests_and_in_flight_ones_move_to_a_new_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demand_module, "REACQUIRE_S", (0.05, 0.1))

    async def main() -> None:
        r = rig()
        r.daemon.away = 2  # the first two acquires find gpuswapd gone
        replies = await asyncio.gather(*(r.client.post("/v1/chat/completions", json=chat("hyperqwen"))
                                         for _ in range(6)))
        assert [x.status_code for x in replies] == [200] * 6
        assert r.daemon.reclaims[:3] == [None, "token-1", "token-1"]  # its place in the queue reclaimed
        done = asyncio.Event()
        flights: list[Any] = []
        task = asyncio.create_task(_hold_request(r, "default", done, flights))
        await asyncio.sleep(0.1)
        old = r.demand.leases["default"]
        r.daemon.helds[-1].events_in.put_nowait(None)  # the lease's connection ends: gpuswapd restarted
        await asyncio.sleep(0.3)
        new = r.demand.leases["default"]
        assert new is not old and flights[0].lease is new and flights[0] in new.flights
        assert r.daemon.reclaims[-1] == old.held.token  # the lease was reclaimed with its token
        done.set()
        await task
        await r.demand.close()
    run(main())


def test_a_client_that_hangs_up_while_its_window_boots_is_rejoined_by_its_retry() -> None:
    async def main() -> None:
        r = rig()
        r.daemon.gate.clear()
        first = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen")))
        await asyncio.sleep(0.1)
        first.cancel()  # the client's own timeout
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0.05)
        retry = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen")))
        await asyncio.sleep(0.3)  # past the grace: the retry holds the boot
        r.daemon.gate.set()
        assert (await retry).status_code == 200
        assert r.daemon.acquires == ["default"] and r.daemon.withdrawn == 0
        await r.demand.close()
    run(main())


def test_a_resident_request_while_the_resident_is_down_waits_for_it_and_is_answered() -> None:
    down = {"on": True}
    refused: list[str] = []

    async def hook(request: httpx.Request) -> None:
        if request.url.port == 8090 and down["on"]:
            refused.append(request.method)
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    async def main() -> None:
        r = rig(hook=hook)
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("strata")))
        await asyncio.sleep(0.3)
        assert not ask.done() and refused[0] == "POST" and not r.follow.resident_serves()
        down["on"] = False  # the resident is back: its model list answers
        reply = await ask
        assert reply.status_code == 200, reply.text
        assert [str(c.url) for c in r.upstream_calls] == ["http://127.0.0.1:8090/v1/chat/completions"]
        await r.app.shutdown()
    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_preemption_in_prefill_says_preempted(stream: bool) -> None:
    prefill = asyncio.Event()

    async def hook(request: httpx.Request) -> None:
        if request.url.port == 18020:
            prefill.set()
            await asyncio.sleep(30)  # the engine's prefill, cut by the preemption

    async def main() -> None:
        r = rig(hook=hook)
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen", stream=stream)))
        await prefill.wait()
        held = r.daemon.helds[0]
        held.events_in.put_nowait({"event": "preempting", "by": "urgent", "grace_s": 0})
        held.events_in.put_nowait({"event": "preempted", "by": "urgent", "priority": 10})
        await asyncio.wait({ask}, timeout=5)
        assert ask.done(), "the request went on after the preemption cut its window"
        reply = ask.result()
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "preempted" and "preempted by urgent" in error["message"]
        assert "prefill" in error["message"]
        await r.demand.close()
    run(main())


def test_a_passed_request_waits_for_the_resident_but_holds_no_drain() -> None:
    async def main() -> None:
        r = rig()
        r.follow.mark_draining()
        ask = asyncio.create_task(r.client.get("/running"))
        await asyncio.sleep(0.2)
        assert not ask.done() and r.upstream_calls == []  # waits, as a resident request would
        r.follow.take({"event": "window_finished", "outcome": "closed"})
        assert (await ask).status_code == 200
        seen: list[int] = []
        original = r.app.upstream.open

        async def peek(*args: object) -> object:
            seen.append(r.demand.resident_in_flight())
            return await original(*args)  # type: ignore[arg-type]
        r.app.upstream.open = peek  # type: ignore[method-assign]
        await r.client.get("/api/events")
        await r.client.post("/v1/messages", json=chat("strata"))
        assert seen == [0, 1]  # only the resident's work is counted for the drain
    run(main())


def test_a_name_not_known_yet_is_asked_of_llama_swap_with_the_clients_key() -> None:
    async def main() -> None:
        r = rig()
        key = {"authorization": "Bearer sk-llama-swap"}
        assert (await r.client.post("/v1/chat/completions", json=chat("coder"))).status_code == 404
        reply = await r.client.post("/v1/chat/completions", json=chat("coder"), headers=key)
        assert reply.status_code == 200 and reply.json()["port"] == 8090  # the alias, learned with the key
        assert r.app.tenants.route("coder-7b") is r.app.tenants.resident
        long = "x" * 900
        reply = await r.client.post("/v1/chat/completions", json=chat(long), headers=key)
        error = reply.json()["error"]
        assert reply.status_code == 404 and "coder-7b" in error["message"] and "(900 characters)" in error["message"]
        assert long not in reply.text  # never the whole name back
        # With the resident down, an unknown name is a 404 at once; a name last seen as its waits.
        r.follow.take({"event": "phase_entered", "phase": "BOOTING"})
        assert (await r.client.post("/v1/chat/completions", json=chat("nobody"), headers=key)).status_code == 404
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("coder")))
        await asyncio.sleep(0.2)
        assert not ask.done()
        ask.cancel()
        await r.demand.close()
    run(main())


def test_loading_state_streams_the_windows_progress_as_reasoning_text() -> None:
    async def main() -> None:
        r = rig(loading_state=True)
        r.daemon.gate.clear()
        ask = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen", stream=True)))
        await asyncio.sleep(0.3)
        r.daemon.gate.set()
        reply = await ask
        events = [json.loads(line.removeprefix("data: ")) for line in reply.text.splitlines()
                  if line.startswith("data: {")]
        said = events[0]["choices"][0]["delta"]["reasoning_content"]
        assert events[0]["object"] == "chat.completion.chunk" and said.startswith("gpuswapd: BOOTING ")
        assert not reply.text.startswith(":")  # no SSE comments for clients that show nothing of them
        assert '"usage": {"completion_tokens": 3}' in reply.text and reply.text.endswith("data: [DONE]\n\n")
        await r.demand.close()
    run(main())


def test_errors_take_the_shape_of_the_route_and_every_429_and_503_says_when_to_retry() -> None:
    async def main() -> None:
        r = rig(max_waiting=1)
        reply = await r.client.post("/v1/messages", json=chat("gpt-9"))
        assert reply.status_code == 404
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "not_found_error"
        assert (await r.client.post("/v1/chat/completions", json=chat("gpt-9"))).json()["error"]["code"] == \
            "model_not_found"
        r.daemon.gate.clear()
        first = asyncio.create_task(r.client.post("/v1/messages", json=chat("qwen-eval")))
        await asyncio.sleep(0.1)
        crowded = await r.client.post("/v1/messages", json=chat("qwen-eval"))
        assert crowded.status_code == 429 and crowded.headers["retry-after"] == "5"
        assert crowded.json()["error"]["type"] == "rate_limit_error"
        r.daemon.gate.set()
        assert (await first).status_code == 200
        await r.demand.close()
    run(main())


def test_metrics_show_the_schedule() -> None:
    async def main() -> None:
        r = rig(idle=60.0, hold=20.0)
        done = asyncio.Event()
        first = asyncio.create_task(_hold_request(r, "default", done))
        await asyncio.sleep(0.1)
        r.follow.take({"event": "phase_entered", "phase": "READY"})
        waiter = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("strata")))
        again = await r.client.post("/v1/chat/completions", json=chat("hyperqwen"))  # boards: no swap
        assert again.status_code == 200
        await asyncio.sleep(0.1)
        text = (await r.client.get("/metrics")).text
        assert 'gpuswapd_gateway_on_card{tenant="default"} 1.0' in text
        assert 'gpuswapd_gateway_on_card{tenant="resident"} 0.0' in text
        assert 'gpuswapd_gateway_queue{tenant="resident"} 1.0' in text
        left = float(text.split('gpuswapd_gateway_residency_left_seconds{tenant="default"} ')[1].split()[0])
        assert 0 < left <= 10.0
        assert 'gpuswapd_gateway_no_swap_total{tenant="default"} 1.0' in text
        done.set()
        await first
        r.follow.take({"event": "window_finished", "outcome": "closed"})
        assert (await waiter).status_code == 200
        await r.demand.close()
    run(main())


def test_a_window_granted_after_its_client_hung_up_is_given_back_when_the_grace_ends() -> None:
    async def main() -> None:
        r = rig(idle=60.0)
        r.daemon.gate.clear()
        first = asyncio.create_task(r.client.post("/v1/chat/completions", json=chat("hyperqwen")))
        await asyncio.sleep(0.1)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        r.daemon.gate.set()  # the boot ends in the grace: granted, nobody back
        await asyncio.sleep(0.1)
        assert r.daemon.leases and r.daemon.withdrawn == 0
        await asyncio.sleep(0.4)
        assert r.daemon.released == ["lease-1"]  # the grace (0.2 s), not idle (60 s)
    run(main())


def test_the_residency_grows_with_gpuswapds_price_of_a_swap() -> None:
    async def main() -> None:
        r = rig(hold=3600.0)
        before = r.demand.residency("resident", "default")
        price = {"default": {"open_s": 45.0, "resident_restart_s": 12.0}, "eval": {"open_s": None}}
        real_request = r.daemon.request

        async def request(message: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
            reply = await real_request(message, timeout)
            return {**reply, "price": price} if message["op"] == "status" else reply
        r.daemon.request = request  # type: ignore[method-assign]
        await r.demand.start()
        assert r.demand.price == {"default": 45.0, "resident": 12.0}
        assert r.demand.residency("resident", "default") == demand_module.RESIDENCY_PER_SWAP * 57.0 > before
        assert r.demand.residency("resident", "eval") == demand_module.RESIDENCY_PER_SWAP * (12.0 + 10.0)
        # gpuswapd's own rule (daemon.residency_factor, residency_max) is the gateway's too.
        r.demand.take_price({"schedule": {"residency_factor": 2.0, "residency_max_s": 100.0}})
        assert r.demand.residency("resident", "eval") == 2.0 * (12.0 + 10.0)
        assert r.demand.residency("resident", "default") == 100.0  # 2 x 57 s, capped
        r.demand.take_price({"schedule": {"residency_factor": "many", "residency_max_s": -1}})  # ignored
        assert r.demand.residency("resident", "default") == 100.0
    run(main())


def test_the_residency_leaves_a_waiter_most_of_its_hold_for_the_move() -> None:
    async def main() -> None:
        r = rig(hold=120.0)
        r.demand.take_price({"price": {"default": {"open_s": 180.0, "resident_restart_s": 60.0}}})
        assert r.demand.residency("resident", "default") == 30.0  # 4 x 240 s, but hold / 4
    run(main())


def test_a_tenant_that_gave_the_card_up_waits_its_turn_again_and_does_not_take_it_straight_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demand_module, "RESIDENCY_MIN_S", 0.3)
    monkeypatch.setattr(demand_module, "RESIDENCY_PER_SWAP", 0.0)  # every residency is its least, 0.3 s

    async def main() -> None:
        r = rig(idle=60.0, hold=20.0)
        first_done, resident_done = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_hold_request(r, "default", first_done))
        await asyncio.sleep(0.05)
        r.follow.take({"event": "phase_entered", "phase": "READY"})
        resident_flights: list[Any] = []
        resident = asyncio.create_task(_hold_request(r, "resident", resident_done, resident_flights))
        await asyncio.sleep(0.4)  # the resident request has waited past default's residency
        second = asyncio.create_task(_hold_request(r, "default", resident_done))
        await asyncio.sleep(0.05)
        assert r.demand.queue() == {"resident": 1, "default": 1}  # default's new request yields
        await asyncio.sleep(0.4)  # and waits past the resident's residency meanwhile
        first_done.set()
        await first
        await asyncio.sleep(0.05)
        assert r.daemon.released == ["lease-1"]
        r.follow.take({"event": "window_finished", "outcome": "closed"})
        await asyncio.sleep(0.1)
        assert resident_flights, "the resident did not get its turn: default took the card straight back"
        assert r.daemon.acquires == ["default"]
        await asyncio.sleep(0.4)  # default waits the resident's residency, then asks for the card
        assert r.daemon.acquires == ["default", "default"]
        resident_done.set()
        await asyncio.gather(resident, second)
        await r.demand.close()
    run(main())


@pytest.mark.parametrize(("raw", "kind", "said"), [
    ('{"model": "strata"}'.encode("utf-16"), "application/json", "UTF-16"),
    ('{"model": "strata"}'.encode("utf-16-le"), "application/json", "UTF-16"),
    (b'{"model": "strata", "temperature": NaN}', "application/json", "NaN"),
    (b'{"model": "strata", "temperature": -Infinity}', "application/json", "NaN"),
    (_form("")[0], _form("")[1], "no \"model\" field"),
    (b"--x\r\n", "multipart/form-data", "no boundary"),
])
def test_bodies_that_are_not_plain_json_or_a_form_with_a_model_are_refused(raw: bytes, kind: str, said: str) -> None:
    with pytest.raises(BadBody, match=said):
        routes.asked(raw, kind.encode())


def test_a_form_names_its_model_and_stream() -> None:
    body, kind = _form("whisper")
    assert routes.asked(body, kind.encode()) == routes.Asked("whisper", False)
    quoted = body.replace(b"--b0undary--", b"--b0undary\r\nContent-Disposition: form-data; name=stream\r\n\r\ntrue\r\n"
                                           b"--b0undary--")
    assert routes.asked(quoted, b'multipart/form-data; boundary="b0undary"') == routes.Asked("whisper", True)
    assert json.loads(routes.sse_error(BadBody("no"), True).split(b"data: ")[1])["type"] == "error"


def test_the_gateways_own_routes_stay_its_own() -> None:
    async def main() -> None:
        r = rig()
        r.app._models_read = float("inf")
        assert (await r.client.get("/health")).json()["status"] == "ok"
        assert (await r.client.get("/v1/models")).json()["object"] == "list"
        assert r.upstream_calls == []
    run(main())


def test_a_client_that_stops_reading_is_cut_and_counted() -> None:
    async def main() -> None:
        r = rig()
        from gpuswapd.gateway import app as app_module
        app_module.WRITE_S, saved = 0.1, app_module.WRITE_S
        try:
            async def stuck(_message: object) -> None:
                await asyncio.sleep(10)
            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": None,
                     "query_string": b"", "headers": [(b"content-type", b"application/json")]}
            sent = [{"type": "http.request", "body": json.dumps(chat("strata")).encode(), "more_body": False}]

            async def receive() -> dict[str, object]:
                if sent:
                    return sent.pop()
                await asyncio.sleep(10)
                return {"type": "http.disconnect"}
            with pytest.raises(app_module.NotReading):
                await r.app(scope, receive, stuck)
        finally:
            app_module.WRITE_S = saved
        assert b'outcome="not_reading"' in r.app.meters.render()
    run(main())


def test_upstream_errors_without_retry_after_get_one() -> None:
    async def main() -> None:
        async def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(503, headers={"content-type": "application/json"},
                                  stream=httpx.ByteStream(b'{"error": "loading"}'))
        r = rig()
        r.app.upstream.client._transport = httpx.MockTransport(handler)
        reply = await r.client.post("/v1/chat/completions", json=chat("strata"))
        assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
    run(main())


def test_bodies_held_at_once_are_bounded_as_a_whole_and_given_back() -> None:
    async def main() -> None:
        r = rig(max_bodies=3000)  # max_body is 1 KiB, each counted twice: one body fits, two do not
        r.daemon.gate.clear()
        body = json.dumps({**chat("qwen-eval"), "pad": "x" * 800}).encode()
        first = asyncio.create_task(r.client.post("/v1/chat/completions", content=body))
        await asyncio.sleep(0.1)
        assert r.app.bodies == 2 * len(body)  # held while it waits for its window
        second = await r.client.post("/v1/chat/completions", content=body)
        assert second.status_code == 503 and second.headers["retry-after"] == "5"
        assert "gateway.max_bodies" in second.json()["error"]["message"]
        r.daemon.gate.set()
        assert (await first).status_code == 200
        assert r.app.bodies == 0  # given back
        assert (await r.client.post("/v1/chat/completions", content=body)).status_code == 200
        assert r.app.bodies == 0
        await r.demand.close()
    run(main())


def test_an_upstream_that_goes_quiet_ends_the_stream_with_an_error_event() -> None:
    async def main() -> None:
        async def handler(request: httpx.Request) -> httpx.Response:
            async def stalls() -> Any:
                yield b'data: {"choices": []}\n\n'
                await asyncio.sleep(30)
                yield b"data: [DONE]\n\n"
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stalls())
        r = rig(upstream_idle=0.3)
        r.app.upstream.client._transport = httpx.MockTransport(handler)
        started = asyncio.get_running_loop().time()
        reply = await r.client.post("/v1/messages", json=chat("strata", stream=True))
        assert asyncio.get_running_loop().time() - started < 5
        events = reply.text.split("\n\n")
        assert events[0] == 'data: {"choices": []}' and events[1].startswith("event: error\ndata: ")
        error = json.loads(events[1].split("data: ", 1)[1])
        assert error["type"] == "error" and "upstream_idle" in error["error"]["message"]
        assert b'outcome="upstream_error"' in r.app.meters.render()
    run(main())


def test_an_upstreams_html_error_page_reaches_the_client_as_an_error_object() -> None:
    async def main() -> None:
        async def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(500, headers={"content-type": "text/html"},
                                  stream=httpx.ByteStream(b"<html><h1>Internal Server Error</h1></html>"))
        r = rig()
        r.app.upstream.client._transport = httpx.MockTransport(handler)
        reply = await r.client.post("/v1/messages", json=chat("strata"))
        assert reply.status_code == 500 and reply.headers["content-type"] == "application/json"
        error = reply.json()
        assert error["type"] == "error" and "Internal Server Error" in error["error"]["message"]
        assert b'outcome="upstream_error"' in r.app.meters.render()
    run(main())


@pytest.mark.parametrize(("eval_price", "gap"), [(None, demand_module.BATCH_GAP_S), (0.05, None)])
def test_a_tenant_keeps_the_card_after_its_last_request_only_as_long_as_the_swaps_it_saves_cost(
        eval_price: float | None, gap: float | None) -> None:
    async def main() -> None:
        r = rig(idle=60.0, hold=20.0)
        if eval_price is not None:
            r.demand.price["eval"] = eval_price  # as gpuswapd's status or the gateway's own acquires had it
        done = asyncio.Event()
        first = asyncio.create_task(_hold_request(r, "default", done))
        await asyncio.sleep(0.05)
        done.set()
        await first
        expected = r.demand.batch_gap("default", "eval")
        started = time.monotonic()
        reply = await r.client.post("/v1/chat/completions", json=chat("qwen-eval"))
        took = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert r.daemon.acquires == ["default", "eval"]
        if gap is None:  # the default tenant's swaps were seen to take milliseconds: no second of batching
            assert expected < 0.1 and took < 0.5, (expected, took)
        else:  # a tenant not seen yet costs as much as an unknown engine: the default's next request may come
            assert expected == gap and took >= gap - 0.1, (expected, took)
        await r.demand.close()
    run(main())
