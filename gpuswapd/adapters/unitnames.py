"""Unit names from the kernel and from D-Bus: a process's cgroup, a unit's object path."""

from __future__ import annotations

import re
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from gpuswapd.errors import UnitNotFound

USER_MANAGER = re.compile(r"^user@\d+\.service$")
KNOWN_MAX = 1024  # cgroups whose owner the manager confirmed, remembered (a box has far fewer units)


def unit_from_path(path: str) -> str:
    """Name the unit of a systemd object path (``…/unit/strata_2eservice`` is strata.service)."""
    escaped = path.rsplit("/", 1)[-1]
    out, i = [], 0
    while i < len(escaped):
        if escaped[i] == "_" and i + 2 < len(escaped):
            out.append(chr(int(escaped[i + 1:i + 3], 16)))
            i += 3
        else:
            out.append(escaped[i])
            i += 1
    return "".join(out)


def cgroup_of(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Return a process's cgroup path (the unified hierarchy, else systemd's named one; OSError if unreadable)."""
    lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    chosen = [ln for ln in lines if ln.startswith("0::")] + [ln for ln in lines if ":name=systemd:" in ln]
    for line in chosen:
        path = line.split(":", 2)[2].strip()
        if path and path != "/":
            return path
    return None


def service_prefixes(cgroup: str, scopes: bool = False) -> list[tuple[str, str]]:
    """List each ``NAME.service`` in a cgroup path with the path up to it, outermost first.

    The outermost service that its manager confirms owns that path is the process's unit: a
    cgroup made inside a service (delegation, a user manager) cannot pose as another one.
    """
    kinds = (".service", ".scope") if scopes else (".service",)
    parts = cgroup.strip("/").split("/")
    return [(part, "/" + "/".join(parts[:i + 1])) for i, part in enumerate(parts) if part.endswith(kinds)]


@dataclass(frozen=True)
class Owner:
    """Whose a process is: the system manager's unit that owns its cgroup, or a stranger's.

    ``unit`` is the outermost service (or scope) of the system manager whose ``ControlGroup`` the
    manager confirmed is a prefix of the process's cgroup; None when no unit of that manager owns
    it. A ``user@UID.service`` is a user's own manager: everything under it is a stranger's, whatever
    its cgroups are called (``…/user@1000.service/app.slice/strata.service`` is not strata.service).
    """

    unit: str | None
    cgroup: str  # the confirmed unit's cgroup, else the process's own

    @property
    def user_manager(self) -> bool:
        """Tell whether the owner is a user's own systemd (``user@UID.service``)."""
        return self.unit is not None and USER_MANAGER.match(self.unit) is not None

    @property
    def stranger(self) -> bool:
        """Tell whether no system unit but a user's manager, or none at all, owns the process."""
        return self.unit is None or self.user_manager

    @property
    def name(self) -> str:
        """Name it for a person and for comparisons with unit names (a stranger's never looks like a unit)."""
        if self.unit is None:
            return f"a stranger's: no system unit owns cgroup {self.cgroup}"
        if self.user_manager:
            return f"a stranger's: under {self.unit}, a user's own manager ({self.cgroup})"
        return self.unit


def owner_of(cgroup: str, ask: Callable[[str], str | None],
             known: MutableMapping[str, str] | None = None) -> Owner:
    """Find the system manager's unit that owns ``cgroup``, confirmed by that manager.

    ``ask(unit)`` returns the manager's ``ControlGroup`` of a unit (UnitNotFound if it has none
    such; any other error of the manager propagates: it cannot say now). The outermost service or
    scope whose cgroup the manager confirms is the owner: a cgroup made inside a service (delegation,
    a user manager) cannot pose as another one, and a manager in a container or another PID
    namespace is found under whatever prefix its tree has. ``known`` remembers what was confirmed,
    keyed by cgroup path: the same path always names the same unit, so the answer holds.
    """
    for unit, upto in service_prefixes(cgroup, scopes=True):
        if known is not None and known.get(upto) == unit:
            return Owner(unit, upto)
        try:
            group = ask(unit)
        except UnitNotFound:
            continue
        if group != upto:
            continue  # only looks like this unit's cgroup (made inside another one, or another manager's)
        if known is not None:
            if len(known) >= KNOWN_MAX:
                known.pop(next(iter(known)))
            known[upto] = unit
        return Owner(unit, upto)
    return Owner(None, cgroup)
