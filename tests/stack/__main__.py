"""Command line of the test world: ``python -m tests.stack {up,down,env,status}``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from tests.stack.probe import Probe
from tests.stack.world import Stack, StackError


def main(argv: list[str] | None = None) -> int:
    """Bring the test world up or down, or show how to reach it."""
    parser = argparse.ArgumentParser(prog="python -m tests.stack", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "env", "status"])
    args = parser.parse_args(argv)
    stack = Stack()
    try:
        if args.command == "up":
            took = stack.up()
            print(f"test world up in {took:.1f}s at {stack.paths.root}" if took else "test world already up; reset")
        elif args.command == "down":
            stack.down()
            print("test world down: nothing of it runs")
        elif args.command == "env":
            for key, value in stack.env().items():
                print(f"export {key}={shlex.quote(value)}")
        else:
            if not stack.running():
                print("test world is down")
                return 3
            print(json.dumps(Probe(stack).snapshot(), indent=2))
    except StackError as err:
        print(f"test world: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
