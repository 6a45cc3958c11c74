import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuswapd.errors import RequestError
from gpuswapd.protocol import MAX_SPAN_S, parse_request

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_request_or_a_request_error(frame: bytes) -> None:
    with contextlib.suppress(RequestError):
        parse_request(frame)


@settings(max_examples=150)
@given(st.sampled_from(["acquire", "release", "renew", "status", "plan", "history", "park", "watch", "nope", None, 3,
                        [], {}]),
       st.dictionaries(st.sampled_from(["for", "holder", "lease", "wait", "timeout", "limit", "profile", "priority",
                                        "hold", "remove", "x"]), json_values))
def test_well_formed_json_with_wrong_fields_never_crashes(op: object, fields: dict) -> None:
    try:
        req = parse_request(json.dumps({"op": op, **fields}).encode())
    except RequestError as err:
        assert err.message
        return
    assert req.op == op
    assert req.duration is None or 0 < req.duration <= MAX_SPAN_S


@pytest.mark.parametrize(("frame", "message"), [
    (b"\xff\xfe", "not UTF-8"),
    (b"{", "not JSON"),
    (b"[]", "must be a JSON object"),
    (b'{"op": "explode"}', "unknown op 'explode'"),
    (b'{"op": []}', "unknown op"),
    (b'{"op": {"a": 1}}', "unknown op"),
    (b'{"op": "acquire", "for": "-5m"}', "not a time span"),
    (b'{"op": "acquire", "for": 1e300}', "at most 10 years"),
    (b'{"op": "acquire", "for": "15 parsecs"}', "unknown time unit"),
    (b'{"op": "acquire", "for": true}', "time span"),
    (b'{"op": "acquire", "wait": "yes"}', "'wait' must be true or false"),
    (b'{"op": "acquire", "holder": ""}', "'holder' must be a non-empty"),
    (b'{"op": "status", "for": "1m"}', "unknown field(s) for status: for"),
    (b'{"op": "renew", "lease": "abc"}', "renew needs 'for'"),
    (b'{"op": "history", "limit": 0}', "'limit' must be an integer"),
])
def test_bad_requests_say_what_is_wrong(frame: bytes, message: str) -> None:
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_request(frame)


def test_good_requests() -> None:
    req = parse_request(b'{"op": "acquire", "for": "1h 30min", "holder": "eval", "timeout": 90}')
    assert (req.op, req.duration, req.holder, req.timeout, req.wait) == ("acquire", 5400, "eval", 90, True)
    assert parse_request(b'{"op": "renew", "lease": "abc", "for": 60}').duration == 60


@pytest.mark.parametrize(("frame", "message"), [
    (b'{"op": "history", "limit": ' + b"7" * 5000 + b"}", "will not read"),
    (b'{"op": "status", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32 levels"),
    (b"[" * 100_000, "nested deeper than 32 levels"),
    (b'{"op": "status", "holder": "' + b"[" * 100 + b'"}', "unknown field"),  # brackets in a string are text
])
def test_huge_numbers_and_deep_nesting_are_refused_clearly(frame: bytes, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_request(frame)
