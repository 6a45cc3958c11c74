"""Read the test world's real state, independently of gpuswapd's own adapters.

Tests assert on what this reads: ActiveState over D-Bus (busctl, the systemd tool), ``docker ps``
and the VRAM ledger.
"""

from __future__ import annotations

import json
from typing import Any

from tests.stack.world import AGENTS, OTHER_TIMER, Stack

RESIDENT_UNITS = ("strata.service", "llama-swap.service")
AGENT_TIMERS = tuple(f"agent-{a}.timer" for a in AGENTS)


class Probe:
    """Reads units, containers and VRAM of one stack."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def prop(self, unit: str, name: str, iface: str = "org.freedesktop.systemd1.Unit") -> Any:
        """Read one property of a unit."""
        path = self.stack.manager("LoadUnit", "s", unit)[0]
        return self.stack.bus("get-property", "org.freedesktop.systemd1", path, iface, name)

    def active_state(self, unit: str) -> str:
        """Read a unit's ActiveState."""
        return str(self.prop(unit, "ActiveState"))

    def states(self, units: tuple[str, ...] | list[str]) -> dict[str, str]:
        """Read the ActiveState of several units."""
        return {u: self.active_state(u) for u in units}

    def entered_active_us(self, unit: str) -> int:
        """Read when a unit last became active (CLOCK_REALTIME, microseconds)."""
        return int(self.prop(unit, "ActiveEnterTimestamp"))

    def containers(self, all_: bool = True) -> list[dict[str, str]]:
        """List the containers of the stack's dockerd, as ``docker ps`` shows them."""
        args = ["ps", "--format", "{{json .}}"] + (["-a"] if all_ else [])
        out = self.stack.docker(*args, check=True).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def snapshot(self) -> dict[str, Any]:
        """Return the whole state: units, timers, containers, VRAM, OOMs."""
        return {
            "units": self.states(list(RESIDENT_UNITS)),
            "timers": self.states([*AGENT_TIMERS, OTHER_TIMER]),
            "containers": [{"name": c["Names"], "state": c["State"]} for c in self.containers()],
            "vram": self.stack.ledger(),
            "ooms": self.stack.ooms(),
        }
