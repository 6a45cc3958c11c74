"""Start llama-server on the simulated card as llama.cpp's ``--fit`` would, then become it.

    llama_fit.py [--dir D] [--card N] --name strata --bytes 21GiB [--fit-file F] -- llama-server ARGS...

Without ``F`` (the default in the test world), it is ``gpu_hold.py``: it claims ``--bytes``
and runs the server, or fails as CUDA out of memory. With ``F``, a JSON object::

    {"weights": BYTES, "kv_per_token": BYTES, "margin": BYTES, "target": BYTES, "min_ctx": TOKENS}

the claim follows the context ``-c`` (every slot's KV cache together)::

    claim(ctx) = weights + kv_per_token * ctx + margin        (margin: the compute buffers)

and, as llama.cpp's ``--fit`` does (``--fit-target``, 1024 MiB by default; ``--fit-ctx``,
4096), the server starts with its full ``-c`` only if ``claim(-c) + target`` is free; short of
that it lowers ``-c`` by 256 tokens per slot (``-np``) at a time until it fits, down to
``min_ctx``, and says so on stderr, as llama.cpp says nothing to its clients. Only when even
``claim(min_ctx)`` is not free does it fail, as CUDA out of memory. The lowered ``-c`` is the
one llama-server is run with: its ``/props`` and ``/slots`` say the smaller context.

The claim's lock fd stays open across ``exec`` as with ``gpu_hold.py``: the claim lives exactly
as long as the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

try:
    from . import ledger
except ImportError:
    import ledger  # type: ignore[no-redef]


def claim_of(fit: dict[str, Any], ctx: int) -> int:
    """Return what the server holds with ``ctx`` tokens of context (every slot)."""
    return int(fit["weights"]) + int(fit["kv_per_token"]) * ctx + int(fit["margin"])


def fitted(fit: dict[str, Any], ctx: int, slots: int, free: int) -> int:
    """Return the context --fit starts with when ``free`` bytes are free (the minimum when nothing fits)."""
    floor = min(ctx, int(fit.get("min_ctx", 4096)))
    while ctx > floor and claim_of(fit, ctx) + int(fit.get("target", 0)) > free:
        ctx = max(floor, ctx - 256 * slots)
    return ctx


def _flag(command: list[str], names: tuple[str, ...], default: int) -> tuple[int, int | None]:
    """Return a flag's value and the index of that value in the command (None: not given)."""
    for i, arg in enumerate(command[:-1]):
        if arg in names:
            return int(command[i + 1]), i + 1
    return default, None


def main(argv: list[str] | None = None) -> int:
    """Fit, claim, then exec the server; return an exit code only on failure."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: llama_fit.py [--dir D] [--card N] --name NAME --bytes SIZE [--fit-file F] -- CMD ARGS...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description="claim simulated VRAM as llama.cpp's --fit would, then exec CMD")
    parser.add_argument("--dir", help=f"ledger directory (default ${ledger.ENV_DIR})")
    parser.add_argument("--name", required=True, help="holder name in the ledger")
    parser.add_argument("--bytes", required=True, type=ledger.parse_size, help="the claim without --fit, e.g. 21GiB")
    parser.add_argument("--card", type=int, default=0, help="the GPU to claim on (default 0)")
    parser.add_argument("--fit-file", type=Path, help="the fit's formula (JSON); absent: claim --bytes")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("no command after --")
    try:
        directory = Path(args.dir) if args.dir else ledger.default_dir()
        size = args.bytes
        fit = json.loads(args.fit_file.read_text()) if args.fit_file is not None and args.fit_file.exists() else None
        if fit is not None:
            ctx, at = _flag(command, ("-c", "--ctx-size"), 4096)
            slots, _ = _flag(command, ("-np", "--parallel"), 1)
            free = int(ledger.snapshot(directory, args.card)["free_bytes"])
            chosen = fitted(fit, ctx, slots, free)
            size = claim_of(fit, chosen)
            if chosen != ctx:
                print(f"llama_params_fit: {free / ledger.MiB:.0f} MiB free on device {args.card}, "
                      f"{(claim_of(fit, ctx) + int(fit.get('target', 0))) / ledger.MiB:.0f} MiB wanted: "
                      f"reducing n_ctx from {ctx} to {chosen} to fit in device memory", file=sys.stderr)
                if at is not None:
                    command[at] = str(chosen)
                else:
                    command += ["-c", str(chosen)]
        fd = ledger.claim(directory, args.name, size, args.card)
    except ledger.OutOfMemory as e:
        print(f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {e.wanted_bytes / ledger.MiB:.2f} MiB on "
              f"device {args.card}: cudaMalloc failed: out of memory", file=sys.stderr)
        print(str(e), file=sys.stderr)
        return 1
    except (ledger.LedgerError, OSError, ValueError, KeyError) as e:
        print(f"llama_fit: {e}", file=sys.stderr)
        return 1
    os.environ["GPUSIM_HOLD_FD"] = str(fd)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"llama_fit: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
