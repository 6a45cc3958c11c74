"""A direct switch between two engine profiles against closing to the resident and opening again.

    .venv/bin/python -m tests.benchmarks.switch_bench [--cycles 10] [--lag SECONDS] [--boot-delay S]

On the test world, with two engine profiles (the default engine and "eval", a second container),
every cycle runs each variant once, in turn, from a READY window of the default profile held by
lease A, timing from the release of A until lease B on "eval" is held:

- **direct**: B's acquire waits in the queue (sent before, by a connected client; queued once
  the running ``watch`` says ``request_queued``); A is released, and B's reply is awaited
  (engine A down, engine B up, the resident never started in between).
- **via the resident**: nobody is queued; A is released, and the moment the running ``watch``
  says ``window_finished`` (the resident started and verified, the timers back), a client
  already connected sends B's acquire; its reply is awaited.

Both variants are timed from the same kind of client: connections opened before the clock
starts, events from one running subscription, nothing polled with sleeps inside the span. The
difference, per cycle, is what the direct switch saves: the resident's start and verify,
resuming and pausing the timers, stopping the resident again, and one VRAM release lag.

What bounds the result (constants of the simulated world, not of gpuswapd):
  - the VRAM release lag (0.5 s, or --lag): paid once by a direct switch (engine A's memory) and
    twice via the resident (engine A's, then the resident's). Under a real driver's lag
    (0.1-1.5 s, sometimes more) the saving grows with it;
  - the engine's boot delay (ENGINE_BOOT_DELAY, 1.0 s, or --boot-delay) and its warmup and
    verify completions: paid by both variants alike;
  - the resident's load and first completion (llama-server on the CPU with a tiny model) and
    llama-swap's 0.25 s health poll: paid only via the resident, so they set most of the saving;
  - the simulated nvidia-smi, a Python script of ~60 ms a read, polled in WAITING_VRAM.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from tests.benchmarks.clients import Events, Later, Ready, acquire, release
from tests.benchmarks.report import (
    SPREAD_HEADER,
    add_world_options,
    alternate,
    figure,
    measured,
    paired,
    parser,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.benchmarks.swap_bench import engine_env, ledger_lag, world
from tests.stack.config import ENGINE_ENV, EVAL_PORT, profile_sections, stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import StackError

START_SPACING_S = 2.5  # between cycles: the resident's restarts stay under systemd's start limit
EVAL = "eval"


def _open_a(daemon: RunningDaemon, events: Events) -> None:
    Ready(daemon.socket).send(acquire("a"))
    events.clear()


def _close_b(daemon: RunningDaemon, events: Events, window: str) -> None:
    Ready(daemon.socket).send(release("b"))
    events.finished(window)


def direct(daemon: RunningDaemon, events: Events) -> dict[str, Any]:
    """Release A while B waits in the queue; time until B holds its lease."""
    _open_a(daemon, events)
    b = Later(daemon.socket, acquire("b", EVAL))
    events.wait_for("request_queued of b", lambda e: e["event"] == "request_queued" and e.get("holder") == "b", 30)
    client = Ready(daemon.socket)
    started = time.monotonic()
    client.send(release("a"))
    got, _ = b.result()
    window = daemon.status()["window"]
    if not window.get("switched_from"):
        raise StackError(f"the eval window did not switch directly:\n{daemon.tail()}")
    _close_b(daemon, events, window["id"])
    return {"switch_s": got - started, "saved": window.get("saved")}


def via_resident(daemon: RunningDaemon, events: Events) -> dict[str, Any]:
    """Release A with nobody queued; on window_finished acquire B; time release → B's lease."""
    _open_a(daemon, events)
    release_a, acquire_b = Ready(daemon.socket), Ready(daemon.socket)
    started = time.monotonic()
    release_a.send(release("a"))
    finished, _ = events.finished()
    got, _ = acquire_b.send(acquire("b", EVAL))
    window = daemon.status()["window"]
    if window.get("switched_from"):
        raise StackError(f"the eval window switched directly, with nobody queued:\n{daemon.tail()}")
    _close_b(daemon, events, window["id"])
    return {"switch_s": got - started, "close_s": finished - started}


def run(cycles: int, lag: float | None = None, boot_delay: float | None = None) -> dict[str, Any]:
    """Alternate a direct switch and a switch via the resident, ``cycles`` times."""
    stack = world(lag)
    result: dict[str, Any] = {}
    with stack.exclusive():
        stack.up()
        os.environ.update(stack.env())
        sections = profile_sections(stack)
        sections["profiles__eval__container"]["env"] = engine_env(
            boot_delay, {**ENGINE_ENV, "PORT": str(EVAL_PORT), "ENGINE_NAME": "qwen-eval", "ENGINE_MODEL": "qwen-eval"})
        path = stack_config(stack, "switch-bench", daemon={"linger": "0s"},
                            window__container={"env": engine_env(boot_delay)}, **sections)
        daemon = RunningDaemon(stack, path, path.parent / "gpuswapd.sock")
        events: Events | None = None
        try:
            daemon.start()
            events = Events(daemon.socket)
            watch = events
            result["constants"] = {"release_lag_s": ledger_lag(stack),
                                   "engine_boot_delay_s": float(engine_env(boot_delay)["ENGINE_BOOT_DELAY"])}

            def spaced(_: str) -> None:
                stack.wait_baseline()
                time.sleep(START_SPACING_S)

            result["variants"] = alternate(cycles, [("via_resident", lambda: via_resident(daemon, watch)),
                                                    ("direct", lambda: direct(daemon, watch))], before=spaced)
            result["ooms"] = stack.ooms()
        except StackError as err:
            raise StackError(f"{err}\ngpuswapd's log ({daemon.log}):\n{daemon.tail(15)}") from err
        finally:
            if events is not None:
                events.close()
            daemon.stop()
            with contextlib.suppress(StackError):  # never hide what failed above
                stack.reset()
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Compute the figures; the saving per cycle."""
    d = [c["switch_s"] for c in result["variants"]["direct"]]
    v = [c["switch_s"] for c in result["variants"]["via_resident"]]
    return {"direct": spread(d), "via_resident": spread(v),
            "close": spread([c["close_s"] for c in result["variants"]["via_resident"]]),
            "saved": spread(paired(v, d, lambda a, b: a - b)),
            "saved_share": spread(paired(v, d, lambda a, b: (a - b) / a))}


def print_report(result: dict[str, Any], stats: dict[str, Any], cycles: int) -> None:
    """Print the table and the saving."""
    rows = [spread_row("direct switch: release A → lease on B", stats["direct"]),
            spread_row("via the resident: release A → lease on B", stats["via_resident"]),
            spread_row("  of it, closing A to the resident (→ window_finished)", stats["close"]),
            spread_row("saved = via the resident - direct, per cycle", stats["saved"]),
            spread_row("  as a share of the way via the resident", stats["saved_share"])]
    print(table(f"\ndirect switch against closing to the resident, {cycles} cycles, variants alternating (seconds)",
                SPREAD_HEADER, rows))
    k = result["constants"]
    print(f"\nthe direct switch saves {figure(stats['saved'])} per switch, at a VRAM release lag of "
          f"{k['release_lag_s']}s and an engine boot delay of {k['engine_boot_delay_s']}s; "
          f"gpuswapd's own estimate in the record: {result['variants']['direct'][-1]['saved']}")
    if result.get("ooms"):
        print(f"out of memory records: {result['ooms']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the switch benchmark."""
    cli = parser("switch_bench", __doc__, cycles_of="a switch via the resident and a direct one")
    add_world_options(cli)
    args = cli.parse_args(argv)
    result = measured("switch_bench", run, args.cycles, args.lag, args.boot_delay)
    if result is None:
        return 1
    stats = analyse(result)
    print_report(result, stats, args.cycles)
    path = write_results("switch_bench", {"result": result, **stats})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
