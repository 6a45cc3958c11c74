"""Hooks with real processes: the event on stdin, at most four at once, killed whole at the timeout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from gpuswapd.events import to_event
from gpuswapd.observe.hooks import Hooks

# A hook: saves its stdin, then does what the event's "then" says (sleep N seconds in a child too, or exit N).
HOOK = """
import json, os, subprocess, sys, time
event = json.loads(sys.stdin.read())
out = sys.argv[1]
with open(os.path.join(out, f"{event['n']}.json"), "w") as f:
    json.dump(event, f)
then = event.get("then", "exit 0").split()
if then[0] == "sleep":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = os.path.join(out, f"{event['n']}.child")
    with open(path + ".tmp", "w") as f:  # whole or not at all: the test reads it once it exists
        f.write(str(child.pid))
    os.replace(path + ".tmp", path)
    time.sleep(float(then[1]))
else:
    print("it went wrong", file=sys.stderr)
    sys.exit(int(then[1]))
"""


def _hooks(tmp_path: Path, timeout: float = 5.0, dropped: list[int] | None = None) -> Hooks:
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    return Hooks([sys.executable, str(script), str(tmp_path)], ["window_failed"], timeout,
                 dropped=lambda: dropped.append(1) if dropped is not None else None)


def _event(n: int, then: str) -> dict[str, Any]:
    return to_event("window_failed", "error", {"n": n, "then": then, "error": "port 18020 is in use"},
                    {"window": "w1", "phase": "DRAINING"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


async def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_at_most_four_run_the_rest_are_dropped_and_counted(tmp_path: Path) -> None:
    dropped: list[int] = []

    async def main() -> None:
        hooks = _hooks(tmp_path, dropped=dropped)
        for n in range(6):
            hooks.on_event(_event(n, "sleep 30"))
        hooks.on_event(to_event("phase_entered", "info", {}, {}))  # not one it wants
        assert hooks.running == 4 and len(dropped) == 2
        await _until(lambda: len(list(tmp_path.glob("*.child"))) == 4)
        await hooks.close()
        assert hooks.running == 0

    asyncio.run(asyncio.wait_for(main(), 30))
    saved = sorted(json.loads(p.read_text())["n"] for p in tmp_path.glob("*.json"))
    assert saved == [0, 1, 2, 3]
    event = json.loads((tmp_path / "0.json").read_text())
    assert event["event"] == "window_failed" and event["error"] == "port 18020 is in use" and event["window"] == "w1"
    for child in tmp_path.glob("*.child"):  # closed with its process group (SIGKILL takes a moment)
        pid = int(child.read_text())
        asyncio.run(_until(lambda pid=pid: not _alive(pid), 5))  # type: ignore[misc]


def test_a_hung_hook_is_killed_with_its_children_at_the_timeout_and_a_failing_one_is_logged(tmp_path: Path) -> None:
    async def main() -> tuple[float, list[dict[str, Any]]]:
        # 2 s: time for the hook's Python to start and spawn its child (which the test then looks for)
        # on a loaded machine, where the interpreter alone may take a second.
        hooks = _hooks(tmp_path, timeout=2.0)
        with structlog.testing.capture_logs() as logs:
            started = time.monotonic()
            hooks.on_event(_event(1, "sleep 30"))
            hooks.on_event(_event(2, "exit 3"))
            await _until(lambda: hooks.running == 0)
            took = time.monotonic() - started
        return took, logs

    took, logs = asyncio.run(asyncio.wait_for(main(), 30))
    assert 2.0 <= took < 8
    timed_out = [e for e in logs if e["event"] == "hook_timed_out"]
    failed = [e for e in logs if e["event"] == "hook_failed"]
    assert len(timed_out) == 1 and timed_out[0]["timeout_s"] == 2.0
    assert len(failed) == 1 and failed[0]["exit_code"] == 3 and "it went wrong" in failed[0]["stderr"]
    child = int((tmp_path / "1.child").read_text())
    asyncio.run(_until(lambda: not _alive(child), 5))


def test_a_hook_that_cannot_start_is_logged(tmp_path: Path) -> None:
    async def main() -> list[dict[str, Any]]:
        hooks = Hooks([str(tmp_path / "gone")], ["window_failed"], 1.0)
        with structlog.testing.capture_logs() as logs:
            hooks.on_event(_event(1, "exit 0"))
            await _until(lambda: hooks.running == 0)
        return logs

    logs = asyncio.run(asyncio.wait_for(main(), 30))
    assert [e["event"] for e in logs] == ["hook_failed"]
