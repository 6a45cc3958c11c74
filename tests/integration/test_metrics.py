"""Every swap visible, on the real world: /metrics, the textfile, gpuswapctl watch and the hooks.

Two windows' worth of world time in all: one cycle checks the metrics, the textfile and watch
together; one refused window and one cycle check the hooks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import assert_resident_back, free_port, scrape, value
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import Probe
from tests.stack.world import ENGINE_PORT, Stack

Start = Callable[..., RunningDaemon]


def http_status(port: int, method: str, path: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


class Watch:
    """``gpuswapctl watch --json``, read on a thread of its own (a watcher that does not read is dropped)."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.proc = subprocess.Popen([str(BIN / "gpuswapctl"), "watch", "--json"], env=daemon.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert json.loads(first) == {"event": "subscribed"}, first + self.proc.stderr.read()  # type: ignore[union-attr]
        self.events: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def wait_for(self, name: str, timeout: float = 60, **fields: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in list(self.events):
                if event["event"] == name and fields.items() <= event.items():
                    return event
            time.sleep(0.05)
        raise AssertionError(f"no {name} {fields} within {timeout}s: {[e['event'] for e in self.events]}")

    def stop(self) -> list[dict[str, Any]]:
        self.proc.terminate()
        self.proc.wait(10)
        self._thread.join(10)
        return self.events


class TextfileReader:
    """Parses the textfile again and again, as node_exporter would, and notes every failure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reads = 0
        self.failures: list[str] = []
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                text = self.path.read_text()
                families = {f.name: f for f in text_string_to_metric_families(text)}
                if "gpuswapd_phase" not in families or "gpuswapd_build_info" not in families:
                    self.failures.append(f"incomplete: {sorted(families)}")
                self.last = families
            except Exception as err:
                self.failures.append(repr(err))
            self.reads += 1
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_one_window_as_metrics_textfile_and_watch_see_it(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    port = free_port()
    directory = world.paths.root / "gpuswapd" / "textfile-test"
    directory.mkdir(parents=True, exist_ok=True)
    textfile = directory / "gpuswapd.prom"
    textfile.unlink(missing_ok=True)
    daemon = gpuswapd(metrics={"listen": f"127.0.0.1:{port}", "textfile": str(textfile)})
    deadline = time.monotonic() + 10
    while not textfile.exists():  # written at start, before any window
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert textfile.stat().st_mode & 0o777 == 0o644
    reader = TextfileReader(textfile)
    watch = Watch(daemon)

    out = daemon.ctl("acquire", "--for", "1m")
    assert out.returncode == 0, out.stderr
    ready = scrape(port)
    assert value(ready, "gpuswapd_leases") == 1
    assert value(ready, "gpuswapd_phase", phase="READY") == 1 and value(ready, "gpuswapd_phase", phase="IDLE") == 0
    assert value(ready, "gpuswapd_vram_free_bytes") > 0
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE")

    [window] = daemon.ctl_json("history")["windows"]
    families = scrape(port)
    assert value(families, "gpuswapd_windows", "gpuswapd_windows_total", outcome="closed") == 1
    assert value(families, "gpuswapd_leases") == 0
    assert value(families, "gpuswapd_phase", phase="IDLE") == 1
    recorded: dict[tuple[str, str], list[float]] = defaultdict(list)
    for t in window["timings"]:
        recorded[(t["phase"], t["stage"])].append(t["took_s"])
    observed: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for s in families["gpuswapd_phase_duration_seconds"].samples:
        if s.name.endswith(("_count", "_sum")):
            observed[(s.labels["phase"], s.labels["stage"])][s.name.rpartition("_")[2]] = s.value
    assert set(observed) == set(recorded)
    for key, took in recorded.items():
        assert observed[key]["count"] == len(took), key
        assert abs(observed[key]["sum"] - sum(took)) <= 0.010, (key, observed[key], took)
    assert value(families, "gpuswapd_leases_ended", "gpuswapd_leases_ended_total", reason="released") == 1
    assert value(families, "gpuswapd_window_open_seconds", "gpuswapd_window_open_seconds_count",
                 profile="default", start="cold") == 1
    assert value(families, "gpuswapd_window_close_seconds", "gpuswapd_window_close_seconds_count") == 1
    assert value(families, "gpuswapd_lease_wait_seconds", "gpuswapd_lease_wait_seconds_count") == 1
    assert (http_status(port, "GET", "/"), http_status(port, "POST", "/metrics")) == (404, 405)

    # The textfile catches up within its second, and no read of it ever failed meanwhile.
    deadline = time.monotonic() + 5
    while "gpuswapd_windows" not in reader.last or value(reader.last, "gpuswapd_windows", "gpuswapd_windows_total",
                                                          outcome="closed") != 1:
        assert time.monotonic() < deadline, "the textfile did not show the finished window"
        time.sleep(0.05)
    reader.stop()
    assert reader.failures == [] and reader.reads > 50, (reader.failures[:5], reader.reads)
    assert not [p.name for p in directory.iterdir() if p.name != "gpuswapd.prom"]  # no temporary left

    events = watch.stop()
    ours = [e for e in events if e.get("window") == window["id"]]
    entered = [(e["phase"], e["stage"]) for e in ours if e["event"] == "phase_entered"]
    assert entered == [(t["phase"], t["stage"]) for t in window["timings"]]
    elapsed = [e["elapsed_s"] for e in ours if e["event"] == "phase_entered"]
    assert elapsed == sorted(elapsed)
    names = [e["event"] for e in ours]
    assert names.index("lease_granted") < names.index("lease_released") < names.index("window_finished")
    assert next(e for e in ours if e["event"] == "lease_released")["reason"] == "released"
    assert next(e for e in ours if e["event"] == "lease_granted")["holder"]
    assert_resident_back(probe)


HOOK = """#!/bin/sh
# Saves each event; hangs on engine_started (with a child), fails on window_failed.
ev=$(cat)
printf '%s\\n' "$ev" > "{dir}/$(date +%s%N).json"
case "$ev" in
  *'"event": "engine_started"'*) sleep 300 & echo $! > "{dir}/sleeper.pid"; wait ;;
  *'"event": "window_failed"'*) echo "the notifier is down" >&2; exit 3 ;;
esac
"""


def test_hooks_never_hold_the_window_up(gpuswapd: Start, probe: Probe, world: Stack) -> None:
    directory = world.paths.root / "gpuswapd" / "hooks-test"
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    hook = world.paths.root / "gpuswapd" / "hook.sh"
    hook.write_text(HOOK.replace("{dir}", str(directory)))
    hook.chmod(0o755)
    daemon = gpuswapd(hooks={"command": [str(hook)], "events": ["engine_started", "window_failed"],
                             "timeout": "4s"})
    watch = Watch(daemon)

    # A window that fails its preflight: the hook gets window_failed with the reason, and fails itself.
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", ENGINE_PORT))
    squatter.listen()
    try:
        out = daemon.ctl("acquire", "--for", "1m")
    finally:
        squatter.close()
    assert out.returncode == 1 and "already in use" in out.stderr
    failed = watch.wait_for("hook_failed", on="window_failed")
    assert failed["exit_code"] == 3 and "the notifier is down" in failed["stderr"]
    [given] = [json.loads(p.read_text()) for p in directory.glob("*.json")]
    assert given["event"] == "window_failed" and given["code"] == "window_failed"
    assert f"port {ENGINE_PORT}" in given["error"] and given["failed_phase"] == "DRAINING" and given["window"]

    # A hook that hangs from BOOTING on: READY comes all the same, and the hook is killed at its timeout.
    started = time.monotonic()
    out = daemon.ctl("acquire", "--for", "1m")
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 4, "the acquire waited for the hook (killed at 4s)"
    ready = watch.wait_for("phase_entered", phase="READY")
    killed = watch.wait_for("hook_timed_out", timeout=20, on="engine_started")
    assert ready["ts"] < killed["ts"]
    sleeper = int((directory / "sleeper.pid").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{sleeper}").exists():  # killed with its process group (a zombie is reaped at once)
        assert time.monotonic() < deadline, "the hook's child outlived it"
        time.sleep(0.05)
    assert daemon.status()["phase"] == "READY"
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE")
    watch.stop()
    assert_resident_back(probe)
    assert os.access(hook, os.X_OK)
