"""A fake ``nvidia-smi`` for simulated RTX 3090s whose memory is the VRAM ledger (one card unless
the ledger has more: ``ledger.py cards N``).

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
        memory.total, memory.used, memory.free (MiB); one row per card
    nvidia-smi --query-compute-apps=FIELDS --format=csv[,noheader][,nounits]
        FIELDS from pid, process_name, used_memory (MiB), gpu_uuid, gpu_name, gpu_bus_id
        one row per process whose PID is known here, with the memory it holds or is
        still freeing (an exited process is listed for the ledger's release lag)
    -i N[,M...] | --id=N[,M...]                     only these cards (index, UUID or bus id)

Card N has its own UUID and bus id (card 0's are UUID and BUS_ID below; card 1 ends in ...7c11
and sits on bus 02, and so on).

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


def uuid(index: int) -> str:
    """The UUID of card ``index`` (card 0's is UUID)."""
    return f"{UUID[:-2]}{0x10 + index:02x}"


def bus_id(index: int) -> str:
    """The PCI bus id of card ``index`` (card 0's is BUS_ID)."""
    return f"00000000:{index + 1:02X}:00.0"


def card_of(ident: str, count: int) -> int | None:
    """The index of the card ``-i`` names (an index, a UUID or a bus id), None if there is none."""
    for index in range(count):
        if ident in (str(index), uuid(index), bus_id(index)):
            return index
    return None


def gpu_row(snap: dict[str, Any], index: int = 0, count: int = 1) -> dict[str, Any]:
    """The values of GPU ``index`` (of ``count``) for ``--query-gpu``."""
    total, used = snap["total_bytes"], snap["used_bytes"]
    return {
        "index": index,
        "name": NAME,
        "gpu_name": NAME,
        "uuid": uuid(index),
        "gpu_uuid": uuid(index),
        "pci.bus_id": bus_id(index),
        "gpu_bus_id": bus_id(index),
        "count": count,
        "driver_version": DRIVER,
        "memory.total": mib(total),
        "memory.used": mib(used),
        "memory.free": mib(max(total - used, 0)),
    }


def app_rows(snap: dict[str, Any], index: int = 0) -> list[dict[str, Any]]:
    """One row per process on GPU ``index`` with a PID known here, for ``--query-compute-apps``.

    Memory that is being freed is still the process's, as a real driver lists it for the lag: a
    process that has exited, or the part a sleeping engine has let go (its row shows what it
    holds and what it is still freeing, together).
    """
    used: dict[int, int] = {}
    for h in snap["holders"]:
        if h["pid"] is not None:
            used[h["pid"]] = used.get(h["pid"], 0) + int(h["bytes"])
    rows = []
    for pid, nbytes in used.items():
        name = process_name(pid)
        rows.append(
            {
                "pid": pid,
                "process_name": name,
                "name": name,
                "used_memory": mib(nbytes),
                "used_gpu_memory": mib(nbytes),
                "gpu_uuid": uuid(index),
                "gpu_name": NAME,
                "gpu_bus_id": bus_id(index),
                "gpu": index,
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
{gpus}
+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |
|        ID   ID                                                               Usage      |
|=========================================================================================|
{processes}
+-----------------------------------------------------------------------------------------+
"""
GPU = """\
|   {index}  {name:<26}     Off |   {bus} Off |                  N/A |
|  0%   35C    P8             20W /  350W | {used:>9} / {total:>9} |      0%      Default |
+-----------------------------------------+------------------------+----------------------+
"""
PROCESS = "|    {gpu}   N/A  N/A  {pid:>9}      C   {name:<40} {used:>10} |"
NO_PROCESS = "|  No running processes found" + " " * 61 + "|"


def summary(snaps: dict[int, dict[str, Any]], count: int) -> str:
    """The default table of the cards in ``snaps`` (by index), close enough to the real one for a human."""
    gpus = []
    processes = []
    for index, snap in snaps.items():
        g = gpu_row(snap, index, count)
        gpus.append(GPU.format(index=index, name=NAME, bus=bus_id(index), used=f"{g['memory.used']}MiB",
                               total=f"{g['memory.total']}MiB"))
        processes += [
            PROCESS.format(gpu=index, pid=a["pid"], name=a["process_name"][:40], used=f"{a['used_memory']}MiB")
            for a in app_rows(snap, index)
        ]
    return TABLE.format(
        date=time.strftime("%a %b %d %H:%M:%S %Y"),
        driver=DRIVER,
        cuda=CUDA,
        gpus="".join(gpus),
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
        every = ledger.snapshot_cards(directory)
    except (ledger.LedgerError, OSError, ValueError):
        sys.stdout.write(DRIVER_FAILED)
        return EXIT_DRIVER
    count = len(every)
    cards = list(range(count))
    if "id" in opts:
        found = [card_of(i.strip(), count) for i in str(opts["id"]).split(",")]
        if any(c is None for c in found):
            sys.stdout.write("No devices were found\n")
            return EXIT_NOT_FOUND
        cards = sorted({c for c in found if c is not None})
    snaps = {c: every[c] for c in cards}
    if opts.get("list"):
        sys.stdout.write("".join(f"GPU {c}: {NAME} (UUID: {uuid(c)})\n" for c in cards))
    elif "query-gpu" in opts:
        sys.stdout.write(csv(opts, GPU_FIELDS, [gpu_row(snap, c, count) for c, snap in snaps.items()]))
    elif "query-compute-apps" in opts:
        sys.stdout.write(csv(opts, APP_FIELDS, [row for c, snap in snaps.items() for row in app_rows(snap, c)]))
    else:
        sys.stdout.write(summary(snaps, count))
    return 0


if __name__ == "__main__":
    sys.exit(main())
