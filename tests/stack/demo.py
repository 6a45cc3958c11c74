"""The demo: gpuswapd takes one full GPU window cycle on the test world, showing each step.

    python -m tests.stack.demo [--keep]     (``bash tests/run demo`` installs what it needs first)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from tests.stack.config import stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import AGENT_TIMERS, RESIDENT_UNITS, Probe
from tests.stack.world import ENGINE_PORT, OTHER_TIMER, PROXY_PORT, Stack, StackError


def step(text: str) -> None:
    """Announce a step."""
    print(f"\n\033[1m▶ {text}\033[0m", flush=True)


def show_world(probe: Probe) -> None:
    """Print the units, timers, container and VRAM as the real systems report them."""
    snap = probe.snapshot()
    units = ", ".join(f"{u.removesuffix('.service')}={s}" for u, s in snap["units"].items())
    agents = {s for t, s in snap["timers"].items() if t in AGENT_TIMERS}
    containers = ", ".join(f"{c['name']} ({c['state']})" for c in snap["containers"]) or "none"
    vram = snap["vram"]
    holders = ", ".join(f"{h['name']} {h['bytes'] / 2**30:.1f} GiB" for h in vram["holders"]) or "nobody"
    print(f"  units:      {units}")
    print(f"  timers:     7 agent timers {'/'.join(sorted(agents))}; {OTHER_TIMER} {snap['timers'][OTHER_TIMER]}")
    print(f"  containers: {containers}")
    print(f"  VRAM:       {vram['used_bytes'] / 2**30:.1f} of {vram['total_bytes'] / 2**30:.0f} GiB used by {holders}")


def completion(port: int, model: str) -> str:
    """Ask a server for a short streamed completion and summarize what came back."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    chunks, usage = 0, {}
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            chunks += bool(event["choices"])
            usage = event.get("usage") or usage
    return f"{usage.get('completion_tokens')} tokens (by usage) in {chunks} SSE chunks"


def follow(daemon: RunningDaemon, until: str, timeout: float = 120) -> None:
    """Print each phase the window passes through until it reaches ``until``."""
    seen, started = None, time.monotonic()
    while time.monotonic() - started < timeout:
        phase = daemon.status()["phase"]
        if phase != seen:
            print(f"  {time.monotonic() - started:5.1f}s  {phase}", flush=True)
            seen = phase
        if phase == until:
            return
        time.sleep(0.05)
    raise StackError(f"the window did not reach {until} in {timeout}s")


def main(argv: list[str] | None = None) -> int:
    """Run the demo."""
    parser = argparse.ArgumentParser(prog="python -m tests.stack.demo", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the test world and gpuswapd running afterwards")
    parser.add_argument("--keep-world", action="store_true", help="leave the test world up, stop gpuswapd")
    args = parser.parse_args(argv)
    stack = Stack()
    with stack.exclusive():
        step("Boot the test world: systemd 252 and dockerd in their own namespaces, llama-server as strata")
        took = stack.up()
        print(f"  up in {took:.1f}s at {stack.paths.root}" if took else "  already up (reset to its baseline)")
        probe = Probe(stack)
        show_world(probe)
        config = stack_config(stack, "demo")
        daemon = RunningDaemon(stack, config, config.parent / "gpuswapd.sock")
        try:
            step(f"Start gpuswapd --config {config}")
            daemon.start()
            print(f"  log: {daemon.log}")

            step("gpuswapctl plan   (a dry run: changes nothing)")
            print(daemon.ctl("plan").stdout, end="")

            step("gpuswapctl acquire --for 2m   (drain, pause timers, stop the resident, wait for VRAM, boot, warm)")
            out = daemon.ctl("acquire", "--for", "2m", "--holder", "demo", capture=False)
            if out.returncode != 0:
                print(f"  acquire failed (exit {out.returncode}); gpuswapd log:\n{daemon.tail()}")
                return 1
            show_world(probe)
            print(f"  engine answers on :{ENGINE_PORT}: {completion(ENGINE_PORT, 'hyperqwen')}")

            step("gpuswapctl release   (stop the engine, wait for VRAM, restore and verify strata, resume timers)")
            daemon.ctl("release", "--holder", "demo", check=True)
            follow(daemon, "IDLE")
            show_world(probe)
            print(f"  resident answers through llama-swap on :{PROXY_PORT}: {completion(PROXY_PORT, 'strata')}")

            step("gpuswapctl status   (the last window and its phase timings)")
            print(daemon.ctl("status").stdout, end="")
            states = probe.states([*RESIDENT_UNITS, *AGENT_TIMERS])
            ok = set(states.values()) == {"active"} and probe.containers() == [] and stack.ooms() == []
            print(f"\n{'✓ full cycle done: the resident is back and verified' if ok else '✗ something is off'}")
            print(f"  try it yourself: eval $(.venv/bin/python -m tests.stack env); "
                  f"export GPUSWAPD_SOCKET={daemon.socket}; {BIN}/gpuswapctl status" if args.keep else "")
            return 0 if ok else 1
        finally:
            if not args.keep:
                daemon.stop()
            if not (args.keep or args.keep_world):
                step("Tear the test world down (nothing of it keeps running)")
                stack.down()


if __name__ == "__main__":
    sys.exit(main())
