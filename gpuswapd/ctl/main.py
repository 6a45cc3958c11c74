"""gpuswapctl: acquire, renew and release the GPU window; status; plan; run a command under a lease.

Exit codes (also in gpuswapctl(1)):
  0  done: the lease is held (acquire, run: CMD's own code), or the request succeeded
  1  the GPU was not obtained: the window failed to open or was closed
  2  usage error: bad arguments
  3  gpuswapd cannot be reached (or it stopped while the request waited and did not come back within its
     reclaim grace: a restart is a pause, the request is sent again with its token);
     status --all: an instance did not answer
  4  refused: a bad request, permission denied, no such lease or profile, or the queue is full
  5  not ready: --no-wait and no window of the profile is open
  6  timed out: --timeout passed before the window was ready

slurm-prolog, slurm-epilog and slurm-reconcile exit 0 or 1 (slurmd drains the node on a failed Prolog).

watch runs until interrupted (exit 0), or exits 3 when gpuswapd closes the connection.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from gpuswapd.ctl.client import BadInstance, Client, Unreachable, socket_path
from gpuswapd.ctl.reclaim import Acquirer
from gpuswapd.ctl.render import Progress, event_line, parked_line, print_plan, print_status
from gpuswapd.ctl.run import run_under_lease
from gpuswapd.ctl.status_all import status_all
from gpuswapd.errors import AcquireTimeout, GpuswapError, NotReady, RequestError, Stopping, WindowError
from gpuswapd.instances import DEFAULT_INSTANCE, valid_name
from gpuswapd.timespan import SpanError, format_span, parse_span

_PROFILE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_REFUSED, EXIT_NOT_READY, EXIT_TIMEOUT = range(7)
NewCommand = Callable[..., argparse.ArgumentParser]  # adds a subcommand that takes the common options


def _span(text: str) -> float:
    try:
        seconds = parse_span(text)
    except SpanError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite time span")
    return seconds


def _lease_span(text: str) -> float:
    if text.strip() == "infinity":
        return float("inf")  # until released: only root may (a Slurm job's lease)
    return _span(text)


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{value} is out of range (1..1000)")
    return value


def _profile(text: str) -> str:
    if not _PROFILE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a profile name (lowercase letters, digits and '-')")
    return text


def _instance(text: str) -> str:
    if text != DEFAULT_INSTANCE and not valid_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an instance name (lowercase letters, digits, '_' and "
                                         "'-', such as 0 for gpuswapd@0; default for gpuswapd.service)")
    return text


def _add_profile(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--profile", type=_profile, default="default", metavar="NAME",
                        help=f"{what} ([profiles.NAME] in gpuswapd's configuration; default: [window])")


def _priority(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -1000 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{value} is out of range (-1000..1000)")
    return value


def _add_priority(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--priority", type=_priority, default=0, metavar="N",
                        help="queue priority (default 0; above daemon.priority_max_nonroot only root); a higher one "
                             "preempts a window whose leases all have lower ones, after a grace period")


def _common_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=argparse.SUPPRESS if suppress else None,
        help="gpuswapd's socket (default: --instance, $GPUSWAPD_SOCKET, $GPUSWAPD_INSTANCE, "
             "or /run/gpuswapd/gpuswapd.sock)",
    )
    parser.add_argument(
        "--instance",
        metavar="NAME",
        type=_instance,
        default=argparse.SUPPRESS if suppress else None,
        help="the gpuswapd of gpuswapd@NAME, on /run/gpuswapd/NAME.sock (default $GPUSWAPD_INSTANCE)",
    )
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS if suppress else False, help="print the reply as JSON"
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the command line."""
    parser = argparse.ArgumentParser(
        prog="gpuswapctl",
        description=__doc__.split("\n")[0],
        epilog="Durations use systemd's syntax: 15m, 1h 30min, 90s.",
    )
    _common_options(parser, suppress=False)
    # The same options after the subcommand; SUPPRESS keeps them from resetting what came before it.
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, suppress=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    new = functools.partial(sub.add_parser, parents=[common])
    for command in _COMMANDS:  # in this order in --help
        command(new)
    return parser


def _acquire_parser(new: NewCommand) -> None:
    acquire = new("acquire", help="hold the GPU window (opening it if needed)")
    acquire.add_argument(
        "--for",
        dest="duration",
        type=_lease_span,
        metavar="SPAN",
        help="lease duration (default: the daemon's default_lease; 'infinity', root only: until released)",
    )
    acquire.add_argument(
        "--holder", metavar="NAME", help="who holds the lease (default: the calling unit, or user[pid])"
    )
    acquire.add_argument("--no-wait", action="store_true", help="fail at once (exit 5) unless a window is already open")
    acquire.add_argument("--timeout", type=_span, metavar="SPAN", help="give up (exit 6) if not ready within SPAN")
    _add_profile(acquire, "the kind of window to hold")
    _add_priority(acquire)


def _renew_parser(new: NewCommand) -> None:
    renew = new("renew", help="extend a lease")
    renew.add_argument("lease", nargs="?", help="lease id (default: the caller's only lease)")
    renew.add_argument(
        "--for", dest="duration", type=_span, metavar="SPAN", required=True, help="new duration from now"
    )
    renew.add_argument("--holder", metavar="NAME", help="whose lease (default: the caller)")


def _release_parser(new: NewCommand) -> None:
    release = new("release", help="give a lease back")
    release.add_argument("lease", nargs="?", help="lease id (default: every lease of the caller)")
    release.add_argument("--holder", metavar="NAME", help="whose leases (default: the caller)")


def _run_parser(new: NewCommand) -> None:
    run = new(
        "run",
        help="hold a lease while a command runs",
        usage="gpuswapctl run [--for SPAN] [--holder NAME] [--timeout SPAN] [--profile NAME] [--priority N] "
              "-- COMMAND [ARG...]",
    )
    run.add_argument(
        "--for", dest="duration", type=_span, metavar="SPAN", help="lease duration, renewed while COMMAND runs"
    )
    run.add_argument("--holder", metavar="NAME", help="who holds the lease (default: the calling unit, or user[pid])")
    run.add_argument("--timeout", type=_span, metavar="SPAN", help="give up (exit 6) if not ready within SPAN")
    _add_profile(run, "the kind of window to run under (a bare one sets CUDA_VISIBLE_DEVICES)")
    _add_priority(run)
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command and its arguments")


def _status_parser(new: NewCommand) -> None:
    status = new("status", help="the window's phase, leases and last timings")
    status.add_argument("--all", action="store_true",
                        help="every instance with a socket in /run/gpuswapd: phase, leases, GPU (exit 3 if any "
                             "did not answer)")


def _plan_parser(new: NewCommand) -> None:
    plan = new("plan", help="what a window would do now (changes nothing)")
    _add_profile(plan, "the kind of window to plan")


def _park_parser(new: NewCommand) -> None:
    park = new("park", help="the engine parked asleep between windows")
    park.add_argument("--remove", action="store_true", help="remove the parked engine now (root and members)")


def _watch_parser(new: NewCommand) -> None:
    new("watch", help="follow the window's events as they happen (until Ctrl-C)")


def _history_parser(new: NewCommand) -> None:
    history = new("history", help="past windows with their phase timings")
    history.add_argument("--limit", type=_limit, default=10, help="how many windows, 1 to 1000 (default 10)")


def _bench_parser(new: NewCommand) -> None:
    bench = new(
        "bench",
        help="measure the window's engine under a lease",
        description="Hold a lease and time streamed completions against the window's engine.",
    )
    bench.add_argument(
        "--prompts",
        default="chat",
        metavar="chat|long-context|FILE.jsonl",
        help='a built-in set, or JSONL of {"prompt"|"messages", "max_tokens"?} (default chat)',
    )
    bench.add_argument("--url", help="chat completions URL (default: the daemon's [window.verify] url)")
    bench.add_argument("--model", help="model name (default: the daemon's [window.verify] model)")
    bench.add_argument(
        "--max-tokens", type=int, default=512, metavar="N", help="per request without its own (default 512)"
    )
    bench.add_argument("--repeat", type=int, default=1, metavar="N", help="run the set N times (default 1)")
    bench.add_argument(
        "--for",
        dest="duration",
        type=_span,
        metavar="SPAN",
        help="lease duration, renewed while it runs (default: the daemon's default_lease)",
    )
    bench.add_argument("--no-lease", action="store_true", help="take no lease (the engine must be up already)")
    _add_profile(bench, "the engine profile to measure (not a bare one)")
    _add_priority(bench)


# slurmd's Prolog= and Epilog=, and the clean-up of a lost Epilog: they find gpuswapd through the map.
def _slurm_prolog_parser(new: NewCommand) -> None:
    new("slurm-prolog", help="Slurm node Prolog: hold the job's GPUs (SLURM_JOB_ID, SLURM_JOB_GPUS)")


def _slurm_epilog_parser(new: NewCommand) -> None:
    new("slurm-epilog", help="Slurm node Epilog: release the job's GPUs")


def _slurm_reconcile_parser(new: NewCommand) -> None:
    new("slurm-reconcile", help="release the leases of Slurm jobs that no longer run")


_COMMANDS: tuple[Callable[[NewCommand], None], ...] = (
    _acquire_parser, _renew_parser, _release_parser, _run_parser, _status_parser, _plan_parser, _park_parser,
    _watch_parser, _history_parser, _bench_parser, _slurm_prolog_parser, _slurm_epilog_parser,
    _slurm_reconcile_parser,
)


def main(argv: list[str] | None = None) -> int:
    """Run gpuswapctl."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "all", False):
        if args.socket or args.instance:
            parser.error("status --all asks every instance: it takes no --socket or --instance")
        return status_all(as_json=args.json)
    if args.command.startswith("slurm-"):
        if args.socket or args.instance:
            parser.error(f"{args.command} finds gpuswapd through the map ($GPUSWAPD_SLURM_MAP): "
                         "it takes no --socket or --instance")
        from gpuswapd.ctl import slurm

        return {"slurm-prolog": slurm.prolog, "slurm-epilog": slurm.epilog,
                "slurm-reconcile": slurm.reconcile}[args.command]()
    try:
        path = socket_path(args.socket, args.instance)
    except BadInstance as err:
        print(f"gpuswapctl: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "run":
            return _run_command(parser, args, path)
        if args.command == "acquire":
            return _acquire(args, path)
        if args.command == "bench":
            # Imported here: httpx would slow every other command's start.
            from gpuswapd.ctl.bench import run_bench

            return run_bench(args, path)
        with Client(path) as client:
            if args.command == "watch":
                return _watch(args, client)
            return _run(args, client)
    except Unreachable as err:
        print(f"gpuswapctl: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except OSError as err:
        print(f"gpuswapctl: lost the connection to gpuswapd: {err.strerror or err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except GpuswapError as err:
        phase = f" (in {err.phase})" if err.phase else ""
        print(f"gpuswapctl: {err.message}{phase}", file=sys.stderr)
        return exit_code(err)
    except KeyboardInterrupt:
        return 130


def exit_code(err: GpuswapError) -> int:
    """Map an error from gpuswapd to the documented exit code."""
    if isinstance(err, AcquireTimeout):
        return EXIT_TIMEOUT
    if isinstance(err, Stopping):
        return EXIT_UNREACHABLE
    if isinstance(err, NotReady):
        return EXIT_NOT_READY
    if isinstance(err, RequestError):
        return EXIT_REFUSED
    if isinstance(err, WindowError):
        return EXIT_FAILED
    return EXIT_FAILED


def _emit(args: argparse.Namespace, reply: dict[str, Any], text: str) -> None:
    print(json.dumps(reply, indent=2) if args.json else text)


def _run(args: argparse.Namespace, client: Client) -> int:
    if args.command == "renew":
        req: dict[str, Any] = {"op": "renew", "for": args.duration}
        req.update({k: v for k, v in (("lease", args.lease), ("holder", args.holder)) if v})
        reply = client.request(req)
        _emit(args, reply, _lease_line(reply["lease"], "renewed") + renew_capped(reply))
    elif args.command == "release":
        req = {"op": "release", **{k: v for k, v in (("lease", args.lease), ("holder", args.holder)) if v}}
        reply = client.request(req)
        _emit(
            args, reply, "\n".join(f"released lease {lease['id']} of {lease['holder']}" for lease in reply["released"])
        )
    elif args.command == "status":
        reply = client.request({"op": "status"})
        print(json.dumps(reply, indent=2)) if args.json else print_status(reply)
    elif args.command == "plan":
        reply = client.request({"op": "plan", "profile": args.profile})
        print(json.dumps(reply, indent=2)) if args.json else print_plan(reply["plan"])
        return EXIT_OK if reply["plan"]["ok"] else EXIT_FAILED
    elif args.command == "park":
        reply = client.request({"op": "park", "remove": args.remove})
        if args.remove:
            _emit(args, reply, f"removed the parked engine {reply['removed']['container']}")
        else:
            _emit(args, reply, parked_line(reply["parked"]))
    elif args.command == "history":
        reply = client.request({"op": "history", "limit": args.limit})
        _emit(args, reply, "\n".join(_history_line(w) for w in reply["windows"]) or "no windows yet")
    return EXIT_OK


def _watch(args: argparse.Namespace, client: Client) -> int:
    try:
        for event in client.watch():
            print(json.dumps(event) if args.json else event_line(event), flush=True)
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how a watch ends
    except BrokenPipeError:  # | head: the reader has what it wanted; nothing more to flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    return EXIT_OK


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace, path: str) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("run needs a command after --")
    return run_under_lease(path, command, _acquire_request(args), quiet=args.json)


def _acquire_request(args: argparse.Namespace) -> dict[str, Any]:
    req: dict[str, Any] = {"op": "acquire", "wait": not getattr(args, "no_wait", False)}
    if args.duration:
        req["for"] = "infinity" if math.isinf(args.duration) else args.duration
    if args.holder:
        req["holder"] = args.holder
    if args.timeout:
        req["timeout"] = args.timeout
    if args.profile != "default":
        req["profile"] = args.profile
    if args.priority:
        req["priority"] = args.priority
    return req


def _acquire(args: argparse.Namespace, path: str) -> int:
    req = _acquire_request(args)
    progress = Progress(enabled=not args.json)
    try:
        # A restart of gpuswapd while it waits is a pause: the request is sent again with its token.
        client, reply = Acquirer(path, req, on_event=progress.event, quiet=args.json).acquire()
        client.close()
    finally:
        progress.close()
    _emit(
        args, reply, _lease_line(reply["lease"], "acquired") + (" (capped by max_lease)" if reply.get("capped") else "")
    )
    return EXIT_OK


def renew_capped(reply: dict[str, Any]) -> str:
    """Say why a renewal was capped, if it was: daemon.max_lease, or a fair claim of another profile."""
    if reply.get("capped_by") == "fair_after":
        waiting = reply.get("waiting") or {}
        return (f" (capped: {waiting.get('holder')} has waited {waiting.get('waited_s', 0):.0f}s for profile "
                f"{waiting.get('profile')}; past daemon.fair_after a renewal keeps the expiry already granted)")
    return " (capped by max_lease)" if reply.get("capped") else ""


def _lease_line(lease: dict[str, Any], verb: str) -> str:
    if lease["expires_at"] is None:
        return f"{verb} lease {lease['id']} for {lease['holder']} until released"
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease["expires_at"]))
    left = format_span(round(lease["remaining_s"]))
    return f"{verb} lease {lease['id']} for {lease['holder']} until {until} ({left} left)"


def _history_line(window: dict[str, Any]) -> str:
    took = (window.get("closed_at") or time.time()) - window["opened_at"]
    error = f" error: {window['error']['message']}" if window.get("error") else ""
    start = window.get("start", "cold")
    smaller = " restored, smaller" if window.get("restored") == "smaller" else ""
    return (f"{window['id']}  {window.get('outcome') or '?':<11} {start:<5} {format_span(round(took, 1))}"
            f"{smaller}{error}")


if __name__ == "__main__":
    sys.exit(main())
