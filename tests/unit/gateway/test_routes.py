"""The gateway's routes on fakes: what is routed by model, what goes to llama-swap, names, error shapes.

The real clients (anthropic, openai's Responses API) and the real llama-swap stand-in are in
tests/integration/test_gateway_routes.py; here the ASGI app runs in-process over MockTransport.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gpuswapd.gateway import routes
from gpuswapd.gateway.errors import BadBody
from tests.unit.gateway.test_gateway import chat, rig, run

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
        r = rig(max_bodies=1500)  # max_body is 1 KiB: one body fits, two do not
        r.daemon.gate.clear()
        body = json.dumps({**chat("qwen-eval"), "pad": "x" * 800}).encode()
        first = asyncio.create_task(r.client.post("/v1/chat/completions", content=body))
        await asyncio.sleep(0.1)
        assert r.app.bodies == len(body)  # held while it waits for its window
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
