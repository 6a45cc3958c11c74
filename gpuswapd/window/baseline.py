"""What the resident is: its identity at one moment, and what gpuswapd knows of it across windows.

Data only (the state document's ``resident``); gpuswapd.window.identity reads, compares and
repairs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuswapd.parts.vram import Holder
from gpuswapd.protocol import JsonObject
from gpuswapd.record import _Fields
from gpuswapd.sizes import format_size


@dataclass(frozen=True)
class Identity:
    """The resident at one moment: its context per slot and slots (llama.cpp), its models, its VRAM."""

    n_ctx: int | None
    slots: int | None
    model_path: str | None
    alias: str | None
    models: tuple[str, ...]
    held_bytes: int | None  # what its processes held on the card (None: no GPU probe, or it could not say)
    held: tuple[Holder, ...] = ()
    at: float = 0.0
    # How its operator runs it: a digest of its units' ExecStart= and Environment= (drop-ins included,
    # as systemd merges them), and the InvocationID of its first unit (None: unknown). A change of
    # either that gpuswapd did not make is its operator's: the baseline follows it, nothing is repaired.
    config: str | None = None
    invocation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the state document, status and history."""
        return {"n_ctx": self.n_ctx, "slots": self.slots, "model_path": self.model_path, "alias": self.alias,
                "models": list(self.models), "held_bytes": self.held_bytes,
                "held": [{"pid": h.pid, "unit": h.unit, "bytes": h.used_bytes} for h in self.held], "at": self.at,
                "config": self.config, "invocation": self.invocation}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Identity:
        """Rebuild from ``to_dict`` output; ValueError names what is wrong."""
        d = _Fields(data, where)
        held = []
        for i, h in enumerate(d.items("held")):
            e = _Fields(h, f"{where}.held[{i}]")
            held.append(Holder(int(e.number("pid")), int(e.number("bytes")), e.text("unit", optional=True)))
        n_ctx, slots, held_bytes = (d.number(k, optional=True) for k in ("n_ctx", "slots", "held_bytes"))
        return cls(None if n_ctx is None else int(n_ctx), None if slots is None else int(slots),
                   d.text("model_path", optional=True), d.text("alias", optional=True), tuple(d.texts("models")),
                   None if held_bytes is None else int(held_bytes), tuple(held), d.number("at", default=0.0),
                   d.text("config", optional=True), d.text("invocation", optional=True))

    def describe(self) -> str:
        """Say it for a person: context, slots, models."""
        ctx = f"n_ctx {self.n_ctx} x {self.slots} slot(s), " if self.n_ctx is not None else ""
        return f"{ctx}models {', '.join(self.models) or '(none)'}"

    def reconfigured(self, was: Identity) -> bool:
        """Tell whether its operator changed how it runs since ``was`` (ExecStart=, Environment=, a drop-in)."""
        return self.config is not None and was.config is not None and self.config != was.config

    def same_as(self, other: Identity) -> bool:
        """Tell whether it says the same as ``other`` (the memory and the time aside)."""
        return (self.n_ctx, self.slots, self.model_path, self.alias, self.models) == (
            other.n_ctx, other.slots, other.model_path, other.alias, other.models)


def smaller(now: Identity, was: Identity, server: str) -> list[str]:
    """Say how ``now`` falls short of ``was``: a smaller context or fewer slots (llama.cpp), a model gone."""
    out = []
    if server == "llama.cpp":
        if was.n_ctx is not None and (now.n_ctx is None or now.n_ctx < was.n_ctx):
            out.append(f"n_ctx {now.n_ctx} (was {was.n_ctx})")
        if was.slots is not None and (now.slots is None or now.slots < was.slots):
            out.append(f"total_slots {now.slots} (was {was.slots})")
    missing = sorted(set(was.models) - set(now.models))
    if missing:
        out.append(f"model(s) {', '.join(missing)} missing (it lists {', '.join(now.models) or 'none'})")
    return out


@dataclass
class Known:
    """What gpuswapd knows of the resident across windows and restarts (the state document's ``resident``)."""

    baseline: Identity | None = None
    footprint: int | None = None  # what its processes held the last time a window stopped it
    changed: JsonObject | None = None  # the last close left it smaller: was, now, why, holders
    warned: int = 0  # the largest footprint warned of: each is warned of once

    def needs(self, configured: int) -> int:
        """Return what the resident needs free: ``gpu.resident_needs``, or more if it was seen to hold more."""
        held = self.baseline.held_bytes if self.baseline is not None else None
        return max(configured, self.footprint or 0, held or 0)

    def to_dict(self) -> dict[str, Any] | None:
        """Serialize for the state document (None when nothing is known yet)."""
        if self.baseline is None and self.footprint is None and self.changed is None:
            return None
        return {"baseline": self.baseline.to_dict() if self.baseline is not None else None,
                "footprint_bytes": self.footprint, "footprint_warned": self.warned, "changed": self.changed}

    @classmethod
    def from_dict(cls, data: Any) -> Known:
        """Rebuild from the state document; ValueError names what is wrong."""
        if data is None:
            return cls()
        d = _Fields(data, "resident")
        baseline = d.table("baseline")
        footprint = d.number("footprint_bytes", optional=True)
        return cls(None if baseline is None else Identity.from_dict(baseline, "resident.baseline"),
                   None if footprint is None else int(footprint), d.table("changed"),
                   int(d.number("footprint_warned", default=0)))

    def status(self, configured: int) -> JsonObject:
        """Describe it for ``status``: the baseline, what the last close found, what the checks use."""
        needs = self.needs(configured)
        return {"baseline": self.baseline.to_dict() if self.baseline is not None else None,
                "changed": self.changed, "degraded": self.changed is not None,
                "footprint_bytes": self.footprint, "needs_bytes": needs, "needs": format_size(needs)}
