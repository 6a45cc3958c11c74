import contextlib
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuswapd.adapters.prometheus import parse_prometheus
from gpuswapd.adapters.streams import Completion, CompletionBuilder, ServerFault, parse_sse_events
from gpuswapd.errors import BadResponse


def chunk(content: str | None = None, reasoning: str | None = None, finish: str | None = None,
          field: str = "reasoning") -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta[field] = reasoning
    return {"object": "chat.completion.chunk", "usage": None,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


# -- SSE -----------------------------------------------------------------------------------------


def test_sse_vllm_stream_until_done() -> None:
    events = [chunk(content=""), chunk(reasoning="Let me"), chunk(content="Hi", finish="stop"),
              usage(5, 7)]
    lines = []
    for e in events:
        lines += [f"data: {json.dumps(e)}", ""]
    lines += [": keep-alive", "", "data: [DONE]", "", "data: {\"after\": \"done\"}", ""]
    assert list(parse_sse_events(lines)) == events


def test_sse_framing_variants() -> None:
    lines = [
        "data:{\"a\":1}\r",             # no space after the colon, CRLF remains
        "data: {\"b\":2}",              # no blank line before the next event
        "id: 7", "retry: 1000", "event: message", "data: {\"c\":", "data: 3}", "",  # multi-line
        ":comment", "",
        "data: {\"d\":4}",              # stream ends without a blank line and without [DONE]
    ]
    assert list(parse_sse_events(lines)) == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]


def test_sse_error_line_of_llama_cpp() -> None:
    lines = ["data: {\"x\":1}", "",
             'error: {"code":500,"message":"slot crashed","type":"server_error"}', ""]
    assert list(parse_sse_events(lines)) == [
        {"x": 1}, {"error": {"code": 500, "message": "slot crashed", "type": "server_error"}}]


def test_sse_error_event_and_vllm_error_chunk() -> None:
    lines = ["event: error", "data: {\"message\":\"boom\"}", "",
             "data: {\"error\":{\"message\":\"EngineDeadError: x\",\"code\":500}}", "",
             "error: not json at all", ""]
    assert list(parse_sse_events(lines)) == [
        {"error": {"message": "boom"}},
        {"error": {"message": "EngineDeadError: x", "code": 500}},
        {"error": {"message": "not json at all"}},
    ]


@pytest.mark.parametrize("bad", ["data: {not json", "data: [1, 2]", "data: \"text\""])
def test_sse_junk_data_is_a_bad_response(bad: str) -> None:
    with pytest.raises(BadResponse, match="event is not"):
        list(parse_sse_events([bad, ""]))


@settings(max_examples=100)
@given(st.lists(st.text(max_size=40)))
def test_sse_never_crashes_on_junk(lines: list[str]) -> None:
    try:
        events = list(parse_sse_events(lines))
    except BadResponse:
        return
    assert all(isinstance(e, dict) for e in events)


@settings(max_examples=100)
@given(st.lists(st.binary(max_size=60)))
def test_sse_never_crashes_on_junk_bytes(pieces: list[bytes]) -> None:
    lines = b"".join(pieces).decode("utf-8", errors="replace").splitlines()
    with contextlib.suppress(BadResponse):
        list(parse_sse_events(lines))


json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=10)
json_objects = st.dictionaries(
    st.text(max_size=8),
    json_scalars | st.lists(json_scalars, max_size=3)
    | st.dictionaries(st.text(max_size=5), json_scalars, max_size=3),
    max_size=4,
)


@settings(max_examples=100)
@given(
    events=st.lists(json_objects, max_size=6),
    data=st.data(),
)
def test_sse_round_trip_with_any_framing(events: list[dict[str, Any]], data: st.DataObject) -> None:
    text = ""
    for event in events:
        if data.draw(st.booleans(), label="comment first"):
            text += ": ping\n"
        if data.draw(st.booleans(), label="id line"):
            text += "id: 1\n"
        body = json.dumps(event, indent=data.draw(st.sampled_from([None, 1]), label="indent"))
        space = data.draw(st.sampled_from(["", " "]), label="space")
        text += "".join(f"data:{space}{part}\n" for part in body.split("\n"))
        text += "\n"
    text += data.draw(st.sampled_from(["data: [DONE]\n\n", "", "data: [DONE]\n\ndata: {}\n\n"]))
    if data.draw(st.booleans(), label="crlf"):
        text = text.replace("\n", "\r\n")
    assert list(parse_sse_events(text.splitlines())) == events


# -- completions ---------------------------------------------------------------------------------


def build(events: list[dict[str, Any]]) -> Completion:
    got = CompletionBuilder(started=100.0)
    for n, event in enumerate(events):
        got.add(event, at=100.5 + n)
    return got.build(at=110.0)


def test_usage_comes_from_the_final_chunk_not_from_counting() -> None:
    reply = build([chunk(content=""), chunk(reasoning="Let me think"),
                   chunk(reasoning=" about it", field="reasoning_content"),
                   chunk(content="Hello there friend"), chunk(content=" bye", finish="stop"),
                   usage(11, 13)])
    assert reply.text == "Hello there friend bye"
    assert reply.reasoning == "Let me think about it"
    assert (reply.prompt_tokens, reply.completion_tokens, reply.chunks) == (11, 13, 4)
    assert reply.finish_reason == "stop" and reply.answered
    assert reply.ttft_s == 1.5 and reply.total_s == 10.0


def test_no_usage_chunk_means_unknown_tokens() -> None:
    reply = build([chunk(content="x", finish="length")])
    assert reply.completion_tokens is None and reply.prompt_tokens is None and reply.chunks == 1


def test_reasoning_in_both_fields_is_not_doubled() -> None:
    both = chunk(reasoning="hmm")
    both["choices"][0]["delta"]["reasoning_content"] = "hmm"
    assert build([both]).reasoning == "hmm"


def test_thinking_only_is_not_an_answer() -> None:
    reply = build([chunk(reasoning="a b c", finish="length"), usage(3, 3)])
    assert not reply.answered and reply.finish_reason == "length" and reply.ttft_s == 0.5
    assert build([chunk(content="\n\n", finish="length")]).answered  # tokens, even if blank


def test_tolerates_odd_chunks() -> None:
    reply = build([{"choices": None}, {"choices": [None, {"delta": None}]}, {"usage": "n/a"},
                   {"choices": [{"delta": {"content": None, "tool_calls": []}}]},
                   {"choices": [{"message": {"content": "whole", "reasoning_content": "r"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": True, "completion_tokens": 2}}])
    assert (reply.text, reply.reasoning, reply.chunks) == ("whole", "r", 1)
    assert (reply.prompt_tokens, reply.completion_tokens) == (None, 2)


def test_error_chunk_raises_with_the_servers_message() -> None:
    got = CompletionBuilder(0.0, "POST http://x/v1/chat/completions")
    got.add(chunk(content="partial"), 0.1)
    with pytest.raises(BadResponse, match=r"POST http://x/v1/chat/completions: .*EngineDeadError: "
                                          r"boom") as info:
        got.add({"error": {"message": "EngineDeadError: boom", "type": "InternalServerError",
                           "code": 500}}, 0.2)
    assert isinstance(info.value.__cause__, ServerFault)  # a 5xx kind of failure: retry-worthy
    with pytest.raises(BadResponse, match="context size") as info:
        got.add({"error": {"code": 400, "message": "exceeds the context size"}}, 0.3)
    assert info.value.__cause__ is None


# -- Prometheus ----------------------------------------------------------------------------------

LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 30
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def test_prometheus_llama_cpp() -> None:
    metrics = parse_prometheus(LLAMA_METRICS)
    assert metrics == {"llamacpp:prompt_tokens_total": 30.0,
                       "llamacpp:requests_processing": 1.0, "llamacpp:requests_deferred": 0.0}


def test_prometheus_labels_sums_and_specials() -> None:
    text = "\n".join([
        '# TYPE vllm:num_requests_running gauge',
        'vllm:num_requests_running{model_name="a"} 2.0',
        'vllm:num_requests_running{model_name="b,c",engine="0"} 1 1700000000000',
        'vllm:num_requests_running { model_name = "q\\"}, x=\\"y\\"" , le="#" , } 3e0',
        'up{job="x y # z",path="C:\\\\dir\\n"} +Inf',
        'down -Inf -5',
        'maybe{a="1"} NaN',
        'openmetrics_bucket{le="0.5"} 4 # {trace_id="abc def"} 0.3 1.5e9',
        '{"utf8.name", region="eu"} 7',
        '   indented_metric   8  ',
        '# EOF',
        '',
    ])
    metrics = parse_prometheus(text)
    assert metrics["vllm:num_requests_running"] == 6.0
    assert metrics["up"] == math.inf and metrics["down"] == -math.inf
    assert math.isnan(metrics["maybe"])
    assert metrics["openmetrics_bucket"] == 4.0
    assert metrics["utf8.name"] == 7.0
    assert metrics["indented_metric"] == 8.0


@pytest.mark.parametrize("line", [
    "no_value", 'bad{a="1"', 'bad{a=1} 2', 'bad{a="1" b="2"} 3', "bad 1 2 3", "bad one",
    "bad 1_000", "foo-1 2", '{"x"} ', 'name{"quoted"} 1', "bad{=\"1\"} 2", '"x" 1',
])
def test_prometheus_skips_malformed_lines(line: str) -> None:
    assert parse_prometheus(f"good 1\n{line}\nalso_good 2\n") == {"good": 1.0, "also_good": 2.0}


@settings(max_examples=100)
@given(st.text())
def test_prometheus_never_crashes_on_junk(text: str) -> None:
    metrics = parse_prometheus(text)
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in metrics.items())


HEAD = "abcxyzABZ_"
TAIL = HEAD + "0189"


def names(head: str, tail: str, size: int) -> st.SearchStrategy[str]:
    return st.builds(lambda h, t: h + t, st.sampled_from(head), st.text(tail, max_size=size))


metric_names = names(HEAD + ":", TAIL + ":", 12)
label_names = names(HEAD, TAIL, 8)
sample_values = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10**6, 10**6).map(float)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


@settings(max_examples=100)
@given(
    samples=st.lists(st.tuples(
        metric_names,
        st.dictionaries(label_names, st.text(max_size=12), max_size=3),
        sample_values,
        st.none() | st.integers(-2**40, 2**40),
    ), max_size=12),
    help_text=st.text(max_size=20).map(lambda t: t.replace("\n", " ")),
)
def test_prometheus_round_trip(samples: list[tuple[str, dict[str, str], float, int | None]],
                               help_text: str) -> None:
    lines: list[str] = []
    expected: dict[str, float] = {}
    for name, labels, value, stamp in samples:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        label_text = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {render_value(value)}"
                     + ("" if stamp is None else f" {stamp}"))
        expected[name] = expected.get(name, 0.0) + value
    metrics = parse_prometheus("\n".join(lines) + "\n")
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == value or (math.isnan(value) and math.isnan(metrics[name]))
