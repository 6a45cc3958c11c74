"""Claim simulated VRAM for a program, then become that program.

    gpu_hold.py [--dir D] [--card N] --name strata --bytes 21GiB -- CMD ARGS...

The claim's lock fd stays open across ``exec``, so the claim lives exactly as long as CMD, and
``/proc/locks`` names CMD's PID (exec keeps the PID). CMD is looked up in ``$PATH``; the fd
number is exported as ``GPUSIM_HOLD_FD``. Out of memory: a CUDA-like message on stderr, exit 1,
CMD is not run (like llama-server failing to allocate its buffers).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    from . import ledger
except ImportError:
    import ledger  # type: ignore[no-redef]


def main(argv: list[str] | None = None) -> int:
    """Claim, then exec the command; return an exit code only on failure."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(
            "usage: gpu_hold.py [--dir D] [--card N] --name NAME --bytes SIZE -- CMD ARGS...", file=sys.stderr
        )
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description="claim simulated VRAM, then exec CMD")
    parser.add_argument("--dir", help=f"ledger directory (default ${ledger.ENV_DIR})")
    parser.add_argument("--name", required=True, help="holder name in the ledger")
    parser.add_argument("--bytes", required=True, type=ledger.parse_size, help="e.g. 21GiB")
    parser.add_argument("--card", type=int, default=0, help="the GPU to claim on (default 0)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    try:
        directory = Path(args.dir) if args.dir else ledger.default_dir()
        fd = ledger.claim(directory, args.name, args.bytes, args.card)
    except ledger.OutOfMemory as e:
        print(
            f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating "
            f"{args.bytes / ledger.MiB:.2f} MiB on device {args.card}: cudaMalloc failed: out of memory",
            file=sys.stderr,
        )
        print(str(e), file=sys.stderr)
        return 1
    except ledger.LedgerError as e:
        print(f"gpu_hold: {e}", file=sys.stderr)
        return 1
    os.environ["GPUSIM_HOLD_FD"] = str(fd)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"gpu_hold: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
