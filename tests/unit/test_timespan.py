import math
import shutil
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuswapd.timespan import SpanError, format_span, parse_span

CASES = {
    "15m": 900, "1h 30min": 5400, "1h30m": 5400, "1.5h": 5400, "90s": 90, "90": 90,
    "2min 30s": 150, "5 min": 300, "500ms": 0.5, "1M": 2629800, "1y": 31557600,
    "1w 2d": 777600, "10sec": 10, "3 hours": 10800, "0": 0,
    "1h 30": 3630, "5m5": 305, ".5s": 0.5,  # a bare trailing number is seconds, as in systemd
}


@pytest.mark.parametrize(("text", "seconds"), CASES.items())
def test_parse_known_spans(text: str, seconds: float) -> None:
    assert parse_span(text) == pytest.approx(seconds)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("text", CASES)
def test_parse_agrees_with_systemd_analyze(text: str) -> None:
    out = subprocess.run(["systemd-analyze", "timespan", text], capture_output=True, text=True, check=True)
    usec = next(int(line.split(":")[1]) for line in out.stdout.splitlines() if "μs:" in line)
    assert parse_span(text) == pytest.approx(usec / 1e6)


@pytest.mark.parametrize("bad", ["", " ", "5 parsecs", "m", "-5m", "1.2.3s", "1.s", "15 m m", "5x"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(SpanError):
        parse_span(bad)


def test_infinity() -> None:
    assert math.isinf(parse_span("infinity"))
    assert format_span(math.inf) == "infinity"


@pytest.mark.parametrize(("seconds", "text"), [(900, "15min"), (5400, "1h 30min"), (90, "1min 30s"),
                                               (2.5, "2.5s"), (0.5, "500ms"), (0, "0"), (86400 + 60, "1d 1min")])
def test_format(seconds: float, text: str) -> None:
    assert format_span(seconds) == text


@given(st.integers(min_value=0, max_value=10**8))
def test_format_parses_back(seconds: int) -> None:
    assert parse_span(format_span(seconds)) == pytest.approx(seconds, abs=1)


@given(st.text(max_size=20))
def test_parse_never_crashes(text: str) -> None:
    try:
        value = parse_span(text)
    except SpanError:
        return
    assert value >= 0
