"""Hostile and broken clients against the real daemon: it answers each clearly and keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import assert_resident_back
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import Probe

Start = Callable[..., RunningDaemon]
NO_DOCKER = {"DOCKER_HOST": "unix:///var/tmp/gpuswapd-no-docker.sock"}  # any acquire fails fast, changes nothing


def _exchange(path: Path, frame: bytes, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Send raw bytes, half-close, and read every line the daemon answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


def _line(data: bytes) -> bytes:
    """Make one request line of arbitrary bytes (several lines would be several requests)."""
    return data.replace(b"\n", b" ") + b"\n"


frames = st.one_of(
    st.binary(max_size=300).map(_line),
    st.text(max_size=200).map(lambda t: _line(t.encode())),
    st.builds(lambda op, extra: json.dumps({"op": op, **extra}).encode() + b"\n",
              st.sampled_from(["release", "renew", "status", "history", "bogus", "", None, 1, []]),
              st.dictionaries(st.sampled_from(["for", "holder", "lease", "wait", "limit", "zzz"]),
                              st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                              max_size=4)),
    st.just(b"{" * 5000 + b"\n"),
    st.just(b"x" * (70 * 1024) + b"\n"),
)


def test_thousands_of_malformed_frames_get_clear_errors(gpuswapd: Start, probe: Probe) -> None:
    daemon = gpuswapd(env=NO_DOCKER)
    answered = {"errors": 0, "ok": 0}

    @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames)
    def one(frame: bytes) -> None:
        replies = _exchange(daemon.socket, frame)
        assert len(replies) == 1, replies
        reply = replies[0]
        if reply["ok"]:
            answered["ok"] += 1
        else:
            answered["errors"] += 1
            assert reply["error"]["code"] and reply["error"]["message"]

    one()
    assert answered["errors"] > 1000
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert daemon.status()["phase"] == "IDLE"
    assert_resident_back(probe)


def test_a_client_that_says_nothing_is_dropped_and_others_are_served(gpuswapd: Start) -> None:
    daemon = gpuswapd(env=NO_DOCKER)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(daemon.socket))
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(str(daemon.socket))
    half.sendall(b'{"op": "sta')  # and never the rest
    assert daemon.status()["phase"] == "IDLE"
    silent.settimeout(15)
    reply = json.loads(silent.recv(4096).splitlines()[0])
    assert reply["error"]["message"] == "no request within 10s"
    silent.close()
    half.close()


async def _request(path: Path, message: dict[str, Any], slow: bool = False) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
    line = json.dumps(message).encode() + b"\n"
    try:
        if slow:  # a byte at a time
            for i in range(len(line)):
                writer.write(line[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.01)
        else:
            writer.write(line)
        while True:
            reply: dict[str, Any] = json.loads(await reader.readline())
            if "event" not in reply:
                return reply
    finally:
        writer.close()


async def _load(path: Path, window_lease: str) -> tuple[list[str], list[float], list[str]]:
    """200 concurrent clients: joins, renews, releases, status (some slow), and silent ones."""
    acquired: list[str] = []
    released: list[str] = []
    status_latency: list[float] = []

    async def joiner(n: int) -> None:
        reply = await _request(path, {"op": "acquire", "for": 300, "holder": f"load-{n}"})
        assert reply["ok"], reply
        acquired.append(reply["lease"]["id"])
        renewed = await _request(path, {"op": "renew", "lease": reply["lease"]["id"], "for": 600})
        assert renewed["ok"] and renewed["lease"]["id"] == reply["lease"]["id"]
        if n % 2:
            gone = await _request(path, {"op": "release", "lease": reply["lease"]["id"]})
            released.extend(lease["id"] for lease in gone["released"])

    async def status(slow: bool) -> None:
        started = time.monotonic()
        reply = await _request(path, {"op": "status"}, slow=slow)
        assert reply["ok"] and reply["phase"] == "READY"
        status_latency.append(time.monotonic() - started)

    async def silent() -> None:
        _reader, writer = await asyncio.open_unix_connection(str(path))
        await asyncio.sleep(3)
        writer.close()

    async def bad() -> None:
        reply = await _request(path, {"op": "renew", "lease": "nope", "for": -1})
        assert not reply["ok"]

    tasks = [joiner(n) for n in range(80)] + [status(slow=n % 4 == 0) for n in range(80)]
    tasks += [silent() for _ in range(20)] + [bad() for _ in range(20)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [f"{i}: {''.join(traceback.format_exception(r))}" for i, r in enumerate(results)
                if isinstance(r, BaseException)]
    assert not failures, failures
    return acquired, status_latency, released


def test_200_concurrent_clients_lose_and_duplicate_no_lease(gpuswapd: Start) -> None:
    daemon = gpuswapd(daemon={"linger": "30s"})
    window_lease = daemon.ctl_json("acquire", "--for", "10m", "--holder", "owner")["lease"]["id"]
    acquired, latency, released = asyncio.run(_load(daemon.socket, window_lease))
    assert len(acquired) == len(set(acquired)) == 80
    leases = daemon.status()["window"]["leases"]
    ids = [lease["id"] for lease in leases]
    assert len(ids) == len(set(ids))
    assert set(ids) == (set(acquired) - set(released)) | {window_lease}
    assert all(lease["remaining_s"] > 500 for lease in leases if lease["id"] in acquired)
    print(f"\nstatus under load: {len(latency)} answered, max {max(latency) * 1000:.0f} ms")
    assert max(latency) < 5.0, f"status took {max(latency):.2f}s under load"


def test_huge_integers_and_deep_nesting_get_a_clear_error_before_authorization(gpuswapd: Start) -> None:
    daemon = gpuswapd(env=NO_DOCKER)
    frames = {
        b'{"op": "status", "limit": ' + b"9" * 5000 + b"}\n": "will not read",
        b'{"op": "acquire", "for": ' + b"[" * 100 + b"]" * 100 + b"}\n": "nested deeper than 32 levels",
        b"[" * 20_000 + b"\n": "nested deeper than 32 levels",
    }
    for frame, message in frames.items():
        [reply] = _exchange(daemon.socket, frame)
        assert not reply["ok"] and reply["error"]["code"] == "bad_request" and message in reply["error"]["message"]
    log = daemon.log.read_text()
    assert "request_crashed" not in log and "Traceback" not in log
    assert daemon.status()["phase"] == "IDLE"
