"""A fake ``nvidia-smi`` for one simulated RTX 3090 whose memory is the VRAM ledger.

The ledger directory is ``$GPUSIM_DIR``, else the path written in a file ``gpusim.dir`` next to
this script (next to the link first, then next to the resolved script, so an installed
``nvidia-smi`` symlink works without the environment). No ledger, or a file
``DIR/nvidia-smi.fail``: the driver "cannot be reached" (its text, or the file's, exit 9).
A file ``DIR/nvidia-smi.hang``: the tool never answers, as with a driver stuck in the kernel.

Supported, in the real tool's formats::

    nvidia-smi                                      summary table
    nvidia-smi -L | --list-gpus
    nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]
        FIELDS from index, name, uuid, pci.bus_id, count, driver_version,
        memory.total, memory.used, memory.free (MiB)
    nvidia-smi --query-compute-apps=FIELDS --format=csv[,noheader][,nounits]
        FIELDS from pid, process_name, used_memory (MiB), gpu_uuid, gpu_name, gpu_bus_id
        one row per live holder whose PID is visible here
    -i N | --id=N                                   only 0 (or the UUID / bus id) exists

Like the real tool, messages go to stdout. Exit codes are the real ones: 2 bad argument or
field, 6 no such GPU, 9 driver not reachable.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    from . import ledger
except ImportError:
    import ledger  # type: ignore[no-redef]

NAME = "NVIDIA GeForce RTX 3090"
UUID = "GPU-5f1c2e3a-0b7d-4c9e-8a61-3d2f9e4b7c10"
BUS_ID = "00000000:01:00.0"
DRIVER = "550.54.14"
CUDA = "12.4"
DRIVER_FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
EXIT_BAD_ARGUMENT = 2
EXIT_NOT_FOUND = 6
EXIT_DRIVER = 9

# field -> (header, unit or "")
GPU_FIELDS = {
    "index": ("index", ""),
    "name": ("name", ""),
    "gpu_name": ("name", ""),
    "uuid": ("uuid", ""),
    "gpu_uuid": ("uuid", ""),
    "pci.bus_id": ("pci.bus_id", ""),
    "gpu_bus_id": ("pci.bus_id", ""),
    "count": ("count", ""),
    "driver_version": ("driver_version", ""),
    "memory.total": ("memory.total [MiB]", "MiB"),
    "memory.used": ("memory.used [MiB]", "MiB"),
    "memory.free": ("memory.free [MiB]", "MiB"),
}
APP_FIELDS = {
    "pid": ("pid", ""),
    "process_name": ("process_name", ""),
    "name": ("process_name", ""),
    "used_memory": ("used_gpu_memory [MiB]", "MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB"),
    "gpu_uuid": ("gpu_uuid", ""),
    "gpu_name": ("gpu_name", ""),
    "gpu_bus_id": ("gpu_bus_id", ""),
}


class Usage(Exception):
    """A command line the real tool would reject (exit 2)."""


def find_dir() -> Path | None:
    """Locate the ledger directory: ``$GPUSIM_DIR`` or a ``gpusim.dir`` file by the script."""
    if os.environ.get(ledger.ENV_DIR):
        return Path(os.environ[ledger.ENV_DIR])
    script = Path(sys.argv[0] if sys.argv and sys.argv[0] else __file__)
    for here in (script.absolute().parent, script.resolve().parent):
        pointer = here / "gpusim.dir"
        if pointer.is_file():
            return Path(pointer.read_text(encoding="utf-8").strip())
    return None


def parse(argv: list[str]) -> dict[str, Any]:
    """Parse the command line the way nvidia-smi accepts it (``--opt=value`` or ``--opt value``)."""
    opts: dict[str, Any] = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, has_value, value = arg.partition("=")
        long_opts = {"--query-gpu", "--query-compute-apps", "--format", "--id"}
        if key in long_opts or key == "-i":
            if not has_value:
                if not args:
                    raise Usage(f"ERROR: Option {key} requires an argument.")
                value = args.pop(0)
            opts["id" if key in ("-i", "--id") else key[2:]] = value
        elif arg in ("-L", "--list-gpus"):
            opts["list"] = True
        elif arg in ("-h", "--help"):
            opts["help"] = True
        else:
            raise Usage(f"ERROR: Option {arg} is not recognized. Please run 'nvidia-smi -h'.")
    query = [k for k in ("query-gpu", "query-compute-apps") if k in opts]
    if len(query) > 1:
        raise Usage("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
    if query:
        table = GPU_FIELDS if query[0] == "query-gpu" else APP_FIELDS
        fields = [f.strip() for f in str(opts[query[0]]).split(",") if f.strip()]
        for f in fields or [""]:
            if f not in table:
                raise Usage(f'Field "{f}" is not a valid field to query.\n')
        opts["fields"] = fields
        fmt = [f.strip() for f in str(opts.get("format", "")).split(",") if f.strip()]
        if "csv" not in fmt or any(f not in ("csv", "noheader", "nounits") for f in fmt):
            raise Usage(f'"--format" must be csv[,noheader][,nounits] with --{query[0]}.')
        opts["header"] = "noheader" not in fmt
        opts["units"] = "nounits" not in fmt
    elif "format" in opts:
        raise Usage("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
    return opts


def mib(nbytes: int) -> int:
    """Whole MiB, rounded down like the real tool."""
    return nbytes // ledger.MiB


def process_name(pid: int) -> str:
    """The holder's executable path (or its comm) as nvidia-smi shows it."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        if argv0:
            return argv0
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "[Not Found]"


def csv(opts: dict[str, Any], table: dict[str, tuple[str, str]], rows: list[dict[str, Any]]) -> str:
    """Render rows as nvidia-smi's ``--format=csv`` output."""
    fields: list[str] = opts["fields"]
    lines = []
    if opts["header"]:
        lines.append(", ".join(table[f][0] for f in fields))
    for row in rows:
        cells = []
        for f in fields:
            unit = table[f][1]
            cells.append(f"{row[f]} {unit}" if unit and opts["units"] else str(row[f]))
        lines.append(", ".join(cells))
    return "".join(line + "\n" for line in lines)


def gpu_row(snap: dict[str, Any]) -> dict[str, Any]:
    """The values of GPU 0 for ``--query-gpu``."""
    total, used = snap["total_bytes"], snap["used_bytes"]
    return {
        "index": 0,
        "name": NAME,
        "gpu_name": NAME,
        "uuid": UUID,
        "gpu_uuid": UUID,
        "pci.bus_id": BUS_ID,
        "gpu_bus_id": BUS_ID,
        "count": 1,
        "driver_version": DRIVER,
        "memory.total": mib(total),
        "memory.used": mib(used),
        "memory.free": mib(max(total - used, 0)),
    }


def app_rows(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per holder with a visible PID, for ``--query-compute-apps``."""
    rows = []
    for h in snap["holders"]:
        if h["pid"] is None:
            continue
        name = process_name(h["pid"])
        rows.append(
            {
                "pid": h["pid"],
                "process_name": name,
                "name": name,
                "used_memory": mib(h["bytes"]),
                "used_gpu_memory": mib(h["bytes"]),
                "gpu_uuid": UUID,
                "gpu_name": NAME,
                "gpu_bus_id": BUS_ID,
            }
        )
    return rows


TABLE = """\
{date}
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver:<22} Driver Version: {driver:<14} CUDA Version: {cuda:<9}|
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|=========================================+========================+======================|
|   0  {name:<26}     Off |   {bus} Off |                  N/A |
|  0%   35C    P8             20W /  350W | {used:>9} / {total:>9} |      0%      Default |
+-----------------------------------------+------------------------+----------------------+

+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |
|        ID   ID                                                               Usage      |
|=========================================================================================|
{processes}
+-----------------------------------------------------------------------------------------+
"""
PROCESS = "|    0   N/A  N/A  {pid:>9}      C   {name:<40} {used:>10} |"
NO_PROCESS = "|  No running processes found" + " " * 61 + "|"


def summary(snap: dict[str, Any]) -> str:
    """The default table, close enough to the real one for a human."""
    g = gpu_row(snap)
    processes = [
        PROCESS.format(pid=a["pid"], name=a["process_name"][:40], used=f"{a['used_memory']}MiB")
        for a in app_rows(snap)
    ]
    return TABLE.format(
        date=time.strftime("%a %b %d %H:%M:%S %Y"),
        driver=DRIVER,
        cuda=CUDA,
        name=NAME,
        bus=BUS_ID,
        used=f"{g['memory.used']}MiB",
        total=f"{g['memory.total']}MiB",
        processes="\n".join(processes) or NO_PROCESS,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the fake nvidia-smi."""
    try:
        opts = parse(sys.argv[1:] if argv is None else argv)
    except Usage as e:
        sys.stdout.write(f"{e}\n")
        return EXIT_BAD_ARGUMENT
    if opts.get("help"):
        sys.stdout.write(__doc__ or "")
        return 0
    directory = find_dir()
    if directory is not None and (directory / "nvidia-smi.hang").exists():
        while True:
            time.sleep(3600)
    fail = directory / "nvidia-smi.fail" if directory else None
    if fail is not None and fail.exists():
        text = fail.read_text(encoding="utf-8") or DRIVER_FAILED
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return EXIT_DRIVER
    try:
        if directory is None:
            raise ledger.LedgerError("no ledger")
        snap = ledger.snapshot(directory)
    except (ledger.LedgerError, OSError, ValueError):
        sys.stdout.write(DRIVER_FAILED)
        return EXIT_DRIVER
    if "id" in opts:
        ids = [i.strip() for i in str(opts["id"]).split(",")]
        if any(i not in ("0", UUID, BUS_ID) for i in ids):
            sys.stdout.write("No devices were found\n")
            return EXIT_NOT_FOUND
    if opts.get("list"):
        sys.stdout.write(f"GPU 0: {NAME} (UUID: {UUID})\n")
    elif "query-gpu" in opts:
        sys.stdout.write(csv(opts, GPU_FIELDS, [gpu_row(snap)]))
    elif "query-compute-apps" in opts:
        sys.stdout.write(csv(opts, APP_FIELDS, app_rows(snap)))
    else:
        sys.stdout.write(summary(snap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
