"""A direct switch between two engine profiles against closing to the resident and opening again.

    .venv/bin/python -m tests.benchmarks.switch_bench [--cycles 5]

On the test world, with two engine profiles (the default engine and "eval", a second container):

- **direct**: a window of the default profile is READY and an acquire for "eval" waits in the
  queue; the default lease is released, and the time until the eval acquire holds its lease is
  measured (engine A down, engine B up, the resident never started in between).
- **via the resident**: the same windows with nobody queued: release the default lease, wait until
  gpuswapd is IDLE (the resident started, verified, the timers back), then acquire "eval"; the
  time from the release to the eval lease is measured.

Both are gpuswapctl wall times. The difference is what the direct switch saves: the resident's
start and verify, resuming and pausing the timers, and stopping the resident again.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Any

from tests.benchmarks.report import measured, parser, spread, spread_row, table, write_results
from tests.stack.config import profile_sections, stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.world import Stack, StackError

START_SPACING_S = 2.5  # between cycles: the resident's restarts stay under systemd's start limit


def _ok(out: subprocess.CompletedProcess[str], what: str) -> None:
    if out.returncode != 0:
        raise StackError(f"{what} failed ({out.returncode}): {out.stderr.strip()}")


def _acquire_later(daemon: RunningDaemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "gpuswapctl"), "acquire", "--for", "10m", *args], env=daemon.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_queued(daemon: RunningDaemon) -> None:
    deadline = time.monotonic() + 30
    while not daemon.status()["queue"]:
        if time.monotonic() > deadline:
            raise StackError(f"the eval acquire never queued:\n{daemon.tail()}")
        time.sleep(0.02)


def direct(daemon: RunningDaemon) -> dict[str, Any]:
    """Release A while B waits in the queue; time until B holds its lease."""
    _ok(daemon.ctl("acquire", "--holder", "a", "--for", "10m"), "acquire a")
    b = _acquire_later(daemon, "--profile", "eval", "--holder", "b")
    _wait_queued(daemon)
    started = time.monotonic()
    _ok(daemon.ctl("release", "--holder", "a"), "release a")
    _, err = b.communicate(timeout=180)
    took = time.monotonic() - started
    if b.returncode != 0:
        raise StackError(f"the eval acquire failed: {err}")
    window = daemon.status()["window"]
    if not window.get("switched_from"):
        raise StackError(f"the eval window did not switch directly:\n{daemon.tail()}")
    _ok(daemon.ctl("release", "--holder", "b"), "release b")
    daemon.wait_phase("IDLE", timeout=180)
    return {"switch_s": took, "saved": window.get("saved")}


def via_resident(daemon: RunningDaemon) -> dict[str, Any]:
    """Release A with nobody queued, wait for the resident, then acquire B; time release → B's lease."""
    _ok(daemon.ctl("acquire", "--holder", "a", "--for", "10m"), "acquire a")
    started = time.monotonic()
    _ok(daemon.ctl("release", "--holder", "a"), "release a")
    daemon.wait_phase("IDLE", timeout=180)
    closed = time.monotonic() - started
    _ok(daemon.ctl("acquire", "--profile", "eval", "--holder", "b", "--for", "10m"), "acquire b")
    took = time.monotonic() - started
    _ok(daemon.ctl("release", "--holder", "b"), "release b")
    daemon.wait_phase("IDLE", timeout=180)
    return {"switch_s": took, "close_s": closed}


def run(cycles: int) -> dict[str, Any]:
    stack = Stack()
    result: dict[str, Any] = {"direct": [], "via_resident": []}
    with stack.exclusive():
        stack.up()
        os.environ.update(stack.env())
        path = stack_config(stack, "switch-bench", daemon={"linger": "0s"}, **profile_sections(stack))
        daemon = RunningDaemon(stack, path, path.parent / "gpuswapd.sock")
        try:
            daemon.start()
            for n in range(cycles):
                for name, variant in (("via_resident", via_resident), ("direct", direct)):
                    stack.wait_baseline()
                    time.sleep(START_SPACING_S)
                    result[name].append(variant(daemon))
                    print(f"{name} {n + 1}/{cycles}: {result[name][-1]['switch_s']:.2f}s", file=sys.stderr)
            result["ooms"] = stack.ooms()
        except StackError as err:
            raise StackError(f"{err}\ngpuswapd's log ({daemon.log}):\n{daemon.tail(15)}") from err
        finally:
            daemon.stop()
            with contextlib.suppress(StackError):  # never hide what failed above
                stack.reset()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser("switch_bench", __doc__, cycles_of="switches per variant").parse_args(argv)
    result = measured("switch_bench", run, args.cycles)
    if result is None:
        return 1
    direct_s = spread([c["switch_s"] for c in result["direct"]])
    via_s = spread([c["switch_s"] for c in result["via_resident"]])
    close_s = spread([c["close_s"] for c in result["via_resident"]])
    rows = [spread_row("direct switch: release A → lease on B", direct_s),
            spread_row("via the resident: release A → lease on B", via_s),
            spread_row("  of it, closing A to the resident (→ IDLE)", close_s)]
    print(table(f"\ndirect switch against closing to the resident, {args.cycles} cycles each (seconds)",
                ("", "min", "median", "max"), rows))
    saved = via_s["median"] - direct_s["median"]
    print(f"\nthe direct switch saves {saved:.2f}s per switch (medians), "
          f"{saved / via_s['median'] * 100:.0f}% of the way through the resident; "
          f"gpuswapd's own estimate in the record: {result['direct'][-1]['saved']}")
    if result.get("ooms"):
        print(f"out of memory records: {result['ooms']}", file=sys.stderr)
    path = write_results("switch_bench", {"result": result, "direct": direct_s, "via_resident": via_s,
                                          "close": close_s, "saved_s": saved})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
