"""``gpuswapctl status --all``: every gpuswapd instance found by its socket, side by side."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from gpuswapd.ctl.client import Client, Unreachable
from gpuswapd.errors import GpuswapError
from gpuswapd.instances import find_instances, runtime_dir

ANSWER_TIMEOUT_S = 10.0  # one instance's status; a hung one must not hold up the others' lines
EXIT_OK, EXIT_UNREACHABLE = 0, 3


@dataclass
class Answer:
    """What one instance said to ``status`` (or why it said nothing)."""

    instance: str
    socket: str
    status: dict[str, Any] | None = None
    error: str | None = None
    leases: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Serialize for ``--json``."""
        s = self.status
        if s is None:
            return {"instance": self.instance, "socket": self.socket, "ok": False, "error": self.error}
        return {"instance": self.instance, "socket": self.socket, "ok": True, "phase": s.get("phase"),
                "gpu_index": gpu_index(s), "leases": self.leases, "queue": len(s.get("queue") or []),
                "window": (s.get("window") or {}).get("id")}


def gpu_index(status: dict[str, Any]) -> int | None:
    """Return the GPU an instance drives (a gpuswapd before instances says it per profile only)."""
    index = status.get("gpu_index", ((status.get("profiles") or {}).get("default") or {}).get("gpu_index"))
    return index if isinstance(index, int) else None


def ask(instance: str, socket: str) -> Answer:
    """Ask one instance for its status, within ANSWER_TIMEOUT_S."""
    try:
        with Client(socket, connect_timeout=ANSWER_TIMEOUT_S) as client:
            status = client.request({"op": "status"}, timeout=ANSWER_TIMEOUT_S)
    except (Unreachable, GpuswapError, OSError, ValueError) as err:
        return Answer(instance, socket, error=str(getattr(err, "message", None) or err))
    leases = list((status.get("window") or {}).get("leases") or [])
    return Answer(instance, socket, status=status, leases=leases)


def status_all(as_json: bool = False, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print every instance's phase, leases and GPU; exit 3 if any did not answer (or none was found)."""
    out, err = out or sys.stdout, err or sys.stderr
    found = find_instances()
    if not found:
        print(f"gpuswapctl: no gpuswapd socket in {runtime_dir()}: is any gpuswapd running? "
              "(systemctl list-units 'gpuswapd*')", file=err)
        if as_json:
            print(json.dumps({"instances": []}, indent=2), file=out)
        return EXIT_UNREACHABLE
    with ThreadPoolExecutor(max_workers=min(16, len(found))) as pool:
        answers = list(pool.map(lambda item: ask(*item), found))
    if as_json:
        print(json.dumps({"instances": [a.to_dict() for a in answers]}, indent=2), file=out)
    else:
        print_table(answers, out)
    silent = [a for a in answers if a.status is None]
    for a in silent:
        print(f"gpuswapctl: instance {a.instance} did not answer on {a.socket}: {a.error}", file=err)
    return EXIT_UNREACHABLE if silent else EXIT_OK


def print_table(answers: list[Answer], out: TextIO) -> None:
    """One line per instance: name, GPU, phase, leases (with holders), socket."""
    rows = [("INSTANCE", "GPU", "PHASE", "LEASES", "SOCKET")]
    for a in answers:
        if a.status is None:
            rows.append((a.instance, "-", "NO ANSWER", "-", a.socket))
            continue
        index = gpu_index(a.status)
        holders = ", ".join(str(lease.get("holder")) for lease in a.leases)
        leases = f"{len(a.leases)}" + (f" ({holders})" if holders else "")
        rows.append((a.instance, "-" if index is None else str(index), str(a.status.get("phase")), leases, a.socket))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] + "\n")
