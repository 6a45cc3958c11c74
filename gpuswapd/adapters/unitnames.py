"""Unit names from the kernel and from D-Bus: a process's cgroup, a unit's object path."""

from __future__ import annotations

from pathlib import Path


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


def unit_from_cgroup(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Name the unit of a process from ``/proc/PID/cgroup`` (OSError if unreadable).

    A process inside another PID namespace's systemd (or a container) may carry a prefix before
    ``system.slice/NAME.service``: take the innermost component that names a unit.
    """
    lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    # cgroup v2 ("0::/...") first, then the named systemd hierarchy of a v1/hybrid setup.
    chosen = [ln for ln in lines if ln.startswith("0::")] + [ln for ln in lines if ":name=systemd:" in ln]
    for line in chosen:
        parts = line.split(":", 2)[2].strip("/").split("/")
        for part in reversed(parts):
            if part.endswith((".service", ".scope")) and part != "init.scope":
                return part
    return None


def cgroup_of(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Return a process's cgroup path (the unified hierarchy, else systemd's named one; OSError if unreadable)."""
    lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    chosen = [ln for ln in lines if ln.startswith("0::")] + [ln for ln in lines if ":name=systemd:" in ln]
    for line in chosen:
        path = line.split(":", 2)[2].strip()
        if path and path != "/":
            return path
    return None


def service_prefixes(cgroup: str) -> list[tuple[str, str]]:
    """List each ``NAME.service`` in a cgroup path with the path up to it, outermost first.

    The outermost service that its manager confirms owns that path is the process's unit: a
    cgroup made inside a service (delegation, a user manager) cannot pose as another one.
    """
    parts = cgroup.strip("/").split("/")
    return [(part, "/" + "/".join(parts[:i + 1])) for i, part in enumerate(parts) if part.endswith(".service")]
