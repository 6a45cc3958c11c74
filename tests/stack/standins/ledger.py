"""The simulated GPU's VRAM ledger, shared by every simulated GPU user through a directory.

Layout of the directory (``--dir`` or ``$GPUSIM_DIR``)::

    ledger.json        {"total_bytes", "release_lag_s", "holders": {NAME: {...}}, "ooms": [...]}
                       and "cards": N when there is more than one card
    ledger.lock        flock(2) guarding every read-modify-write of ledger.json
    holders/NAME.lock  flock(2)ed LOCK_EX by the live holder NAME

A holder is alive while its lock is held. The kernel drops the lock when the last fd of that
open file goes away: when the process dies (in any PID namespace, even in a container that
bind-mounts the directory), but not across ``exec`` (the fd is inheritable), which is how
``gpu_hold.py`` hands a claim to the program it runs.

Memory comes free some time after it is let go, as on a real card (a driver takes some 0.1 to
1.5 s, Ollama waits up to 5 s), and meanwhile the driver still lists it under the process that
held it. So does the ledger, for ``release_lag_s``:

- a dead holder's memory stays used, listed under its PID, from when it is first *seen* dead
  (every read reaps; the world's ``driver`` below reads every 0.1 s);
- a shrinking ``resize()`` (vLLM's sleep mode shrinks its claim to a residual and grows it back
  on wake, keeping the same lock, so the same PID) leaves the difference used, listed under the
  same live PID, for the lag: ``nvidia-smi`` shows the process's memory going down after it.

Lagging memory counts against new claims and growing resizes: restarting a big user too soon
fails with out of memory, as on a real GPU (a growing resize takes back its own lagging memory
first: an engine that wakes at once reuses what it has only just let go).
``release()`` (a live process freeing its memory) frees at once.

Cards: one by default (GPU 0). ``cards N`` gives N cards of ``total_bytes`` each (the simulated
box with several GPUs); a claim names its card (``card=``, default 0), its holder records it as
``"card"`` (only when not 0), and memory is counted, freed and out of memory per card: a claim on
GPU 1 never fails for want of room on GPU 0. ``snapshot(card=N)`` reports one card.

PIDs come from ``/proc/locks``: the kernel names the process that called flock(2), translated
into the reader's PID namespace (0 when not visible there). That PID survives ``exec``; a child
that inherits the fd over ``fork`` holds the lock too, but ``/proc/locks`` still names the
parent, even after the parent has exited. So the PID is checked against ``/proc/PID/fd``, and
if it does not hold the file open any more, ``/proc/*/fd`` is searched for the process that does.

A dead process is in no ``/proc/locks`` any more, so every reader records each live holder's
PID as its own PID namespace numbers it (``"pids": {NAMESPACE: PID}``), and a dead holder is
listed under the PID recorded for the reader's namespace (None if no reader there saw it alive).
A real driver knows every process's host PID from the start; ``ledger.py driver``, which the test
world runs in the host's PID namespace (where gpuswapd, its ``nvidia-smi`` and dockerd run),
plays that part: it reads every 0.1 s, so each holder's host PID is known within 0.1 s of its
claim, and each death is seen within 0.1 s.

CLI::

    ledger.py init --total 24GiB --lag 1.5 [--cards N]
    ledger.py show [--card N] | ooms | reset [--cards N] [--lag S] | cards N | lag S
    ledger.py driver [--while PID:START] [--every S]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
ENV_DIR = "GPUSIM_DIR"
LEDGER = "ledger.json"
LOCK = "ledger.lock"
HOLDERS = "holders"

_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class LedgerError(Exception):
    """The ledger cannot do what was asked."""


class HolderAlive(LedgerError):
    """A claim was made for a name whose holder is still alive."""


class OutOfMemory(LedgerError):
    """A claim did not fit in the free memory (the simulated CUDA out-of-memory error)."""

    def __init__(self, name: str, wanted_bytes: int, free_bytes: int, total_bytes: int, card: int = 0) -> None:
        self.name = name
        self.wanted_bytes = wanted_bytes
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.card = card
        super().__init__(
            f"CUDA error: out of memory (GPU {card}: tried to allocate {gib(wanted_bytes)}; "
            f"{gib(max(free_bytes, 0))} free of {gib(total_bytes)} total) [{name}]"
        )


def parse_size(text: str | int) -> int:
    """Parse a size in bytes: a plain number or one with an IEC suffix (``21GiB``, ``512MiB``)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(f"not a size: {text!r} (use bytes or KiB/MiB/GiB/TiB)")
    return int(float(match.group(1)) * unit)


def gib(nbytes: int) -> str:
    """Format bytes as GiB with two decimals, like CUDA's messages."""
    return f"{nbytes / GiB:.2f} GiB"


def default_dir() -> Path:
    """Return the ledger directory named by ``$GPUSIM_DIR``."""
    value = os.environ.get(ENV_DIR)
    if not value:
        raise LedgerError(f"no ledger directory: pass --dir or set {ENV_DIR}")
    return Path(value)


def _load(directory: Path) -> tuple[dict[str, Any], str]:
    """Read ledger.json (the caller holds the ledger lock); return it and its text."""
    try:
        with open(directory / LEDGER, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise LedgerError(f"no ledger in {directory}: run `ledger.py init` first") from None
    state: dict[str, Any] = json.loads(text)
    return state, text


def _save(directory: Path, state: dict[str, Any], text: str | None = None) -> None:
    """Replace ledger.json atomically (the caller holds the ledger lock)."""
    tmp = directory / f"{LEDGER}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(state, indent=1) if text is None else text)
    # Holders may run as other users (a unit's User=): keep the ledger writable for them.
    os.chmod(tmp, 0o666)
    os.replace(tmp, directory / LEDGER)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[dict[str, Any]]:
    """Hold the ledger lock, yield the state, and write it back if the block ends normally."""
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except FileNotFoundError:
        raise LedgerError(f"no ledger in {directory}: run `ledger.py init` first") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        state, before = _load(directory)
        yield state
        after = json.dumps(state, indent=1)
        if after != before:  # the driver reads ten times a second: rewrite only what changed
            _save(directory, state, after)
    finally:
        os.close(fd)


def _lock_is_held(path: Path) -> bool:
    """Tell whether some process holds the flock on ``path`` (probing from a fresh open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _namespace() -> str:
    """Name this process's PID namespace (``pid:[INODE]``): the PIDs it reads are numbered in it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "pid:[unknown]"


def _reap(directory: Path, state: dict[str, Any], now: float) -> None:
    """Learn live holders' PIDs, mark holders whose lock is free as dead, drop what the lag has freed."""
    here = _namespace()
    for key, holder in list(state["holders"].items()):
        if holder["dead_at"] is None:
            if _lock_is_held(directory / holder["lock"]):
                if here not in holder.setdefault("pids", {}):
                    _learn(directory, holder, here)
            else:
                holder["dead_at"] = now
        if holder["dead_at"] is not None and now >= holder["dead_at"] + state["release_lag_s"]:
            del state["holders"][key]


def _learn(directory: Path, holder: dict[str, Any], here: str) -> int | None:
    """Find a live holder's PID in this namespace and record it (a dead one is found by it later)."""
    pid = holder_pid(directory / holder["lock"])
    if pid is not None:
        holder.setdefault("pids", {})[here] = pid
    return pid


def _pid_of(directory: Path, state: dict[str, Any], key: str, holder: dict[str, Any], here: str) -> int | None:
    """The PID this namespace lists an entry under: a live holder's lock names it; memory being freed keeps it."""
    if holder["dead_at"] is None:
        return _learn(directory, holder, here)
    pid = holder.get("pids", {}).get(here)
    if pid is None and "of" in holder:  # the freed part of a live holder that no reader here had seen
        live = state["holders"].get(key.split("~")[0])
        if live is not None and live["dead_at"] is None and live["registered_at"] == holder["of"]:
            pid = _learn(directory, live, here)
            if pid is not None:
                holder.setdefault("pids", {})[here] = pid
    return int(pid) if pid is not None else None


def _used(state: dict[str, Any], card: int = 0) -> int:
    """Sum the bytes of live and lagging holders on ``card``."""
    return sum(int(h["bytes"]) for h in state["holders"].values() if h.get("card", 0) == card)


def _cards(state: dict[str, Any]) -> int:
    return int(state.get("cards", 1))


def _check_card(state: dict[str, Any], card: int) -> None:
    if not 0 <= card < _cards(state):
        raise LedgerError(f"no GPU {card}: the ledger has {_cards(state)} card(s)")


def _set_cards(directory: Path, state: dict[str, Any], cards: int) -> None:
    """Give the ledger ``cards`` cards (the caller holds the lock); a card still held cannot go."""
    if cards < 1:
        raise LedgerError("a ledger has at least one card")
    _reap(directory, state, time.time())
    held = sorted({h.get("card", 0) for h in state["holders"].values() if h.get("card", 0) >= cards})
    if held:
        raise LedgerError(f"GPU {held[0]} still has holders: stop them before dropping it")
    if cards == 1:
        state.pop("cards", None)  # one card: the ledger of a one-GPU box, as it always was
    else:
        state["cards"] = cards


def init(directory: str | Path, total_bytes: int, release_lag_s: float, cards: int = 1) -> None:
    """Create (or start afresh) the ledger in ``directory``."""
    directory = Path(directory)
    (directory / HOLDERS).mkdir(parents=True, exist_ok=True)
    for d in (directory, directory / HOLDERS):
        os.chmod(d, 0o777)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        os.fchmod(fd, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        state: dict[str, Any] = {"total_bytes": total_bytes, "release_lag_s": release_lag_s, "holders": {}}
        _set_cards(directory, state, cards)
        _save(directory, {**state, "ooms": []})
    finally:
        os.close(fd)


def claim(directory: str | Path, name: str, nbytes: int, card: int = 0) -> int:
    """Claim ``nbytes`` on GPU ``card`` for ``name``; return the inheritable fd whose lock keeps the claim."""
    if not _NAME.match(name):
        raise LedgerError(f"bad holder name {name!r}")
    if nbytes < 0:
        raise LedgerError("cannot claim a negative size")
    directory = Path(directory)
    oom: OutOfMemory | None = None
    fd = -1
    with _locked(directory) as state:
        _check_card(state, card)
        now = time.time()
        _reap(directory, state, now)
        previous = state["holders"].get(name)
        if previous is not None:
            if previous["dead_at"] is None:
                raise HolderAlive(f"{name} is held by a live process")
            # Its memory is still lagging: keep counting it, under another key.
            state["holders"][f"{name}~{previous['registered_at']:.6f}"] = previous
            del state["holders"][name]
        free = state["total_bytes"] - _used(state, card)
        if nbytes > free:
            oom = OutOfMemory(name, nbytes, free, state["total_bytes"], card)
            state["ooms"].append(
                {"name": name, "wanted_bytes": nbytes, "free_bytes": free, "at": now, **_on(card)}
            )
        else:
            rel = f"{HOLDERS}/{name}.lock"
            fd = os.open(directory / rel, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                msg = f"{name}: its lock is held by a process not in the ledger"
                raise HolderAlive(msg) from None
            os.set_inheritable(fd, True)
            state["holders"][name] = {
                "bytes": nbytes,
                "lock": rel,
                "registered_at": now,
                "dead_at": None,
                "pids": {_namespace(): os.getpid()},
                **_on(card),
            }
    if oom is not None:
        raise oom
    return fd


def _on(card: int) -> dict[str, int]:
    """The card of a holder or an OOM record: said only when it is not GPU 0 (one-card ledgers stay as they were)."""
    return {"card": card} if card else {}


def release(directory: str | Path, name: str, fd: int) -> None:
    """Free a live claim at once (a live process freeing its memory) and close its fd."""
    directory = Path(directory)
    with _locked(directory) as state:
        if _own_entry(directory, state, name, fd) is not None:
            del state["holders"][name]
    os.close(fd)


def _own_entry(directory: Path, state: dict[str, Any], name: str, fd: int) -> dict[str, Any] | None:
    """The live entry of ``name`` if ``fd`` is the open file of its lock (None otherwise)."""
    holder: dict[str, Any] | None = state["holders"].get(name)
    if holder is None or holder["dead_at"] is not None:
        return None
    mine = os.fstat(fd)
    try:
        theirs = os.stat(directory / holder["lock"])
    except FileNotFoundError:
        return None
    return holder if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino) else None


def resize(directory: str | Path, name: str, fd: int, nbytes: int) -> None:
    """Change a live claim to ``nbytes``, keeping its lock (``fd``), so its holder and PID stay.

    Shrinking frees the difference after the release lag, as a driver does after vLLM's sleep:
    meanwhile it is still used, listed under the same PID (an entry of its own, ``NAME~...``,
    whose ``dead_at`` is the shrink's time). Growing takes back first what this claim is still
    freeing (its own memory, never free to anyone else yet), then the rest only if it is free,
    others' lagging memory included, else raises OutOfMemory (recorded like a failed claim) and
    leaves the claim as it was.
    """
    if nbytes < 0:
        raise LedgerError("cannot resize to a negative size")
    directory = Path(directory)
    oom: OutOfMemory | None = None
    with _locked(directory) as state:
        now = time.time()
        _reap(directory, state, now)
        holder = _own_entry(directory, state, name, fd)
        if holder is None:
            raise LedgerError(f"{name}: no live claim held through fd {fd}")
        more = nbytes - int(holder["bytes"])
        card = int(holder.get("card", 0))
        parts = sorted((k for k, h in state["holders"].items()
                        if h.get("of") == holder["registered_at"] and k.split("~")[0] == name), reverse=True)
        own = sum(int(state["holders"][k]["bytes"]) for k in parts)
        free = state["total_bytes"] - _used(state, card)
        if more > free + own:
            oom = OutOfMemory(name, more, free, state["total_bytes"], card)
            state["ooms"].append(
                {"name": name, "wanted_bytes": more, "free_bytes": free, "at": now, **_on(card)}
            )
        elif more > 0:
            back = more
            for key in parts:  # the latest first
                take = min(back, int(state["holders"][key]["bytes"]))
                state["holders"][key]["bytes"] -= take
                back -= take
                if state["holders"][key]["bytes"] == 0:
                    del state["holders"][key]
            holder["bytes"] = nbytes
        elif more < 0:
            here = _namespace()
            if here not in holder.setdefault("pids", {}):
                _learn(directory, holder, here)
            state["holders"][f"{name}~{holder['registered_at']:.6f}~{now:.6f}"] = {
                "bytes": -more, "lock": holder["lock"], "registered_at": now, "dead_at": now,
                "pids": dict(holder["pids"]), "of": holder["registered_at"], **_on(card),
            }
            holder["bytes"] = nbytes
    if oom is not None:
        raise oom


def _flock_entries() -> list[tuple[int, int, int]]:
    """List ``(pid, device, inode)`` of the granted FLOCK entries of ``/proc/locks``."""
    entries = []
    try:
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 6741 fe:00:15362107 0 EOF"; waiters have "->" after "1:".
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            dev = os.makedev(int(major, 16), int(minor, 16))
            entries.append((int(parts[4]), dev, int(inode)))
        except ValueError:
            continue
    return entries


def _holds_open(pid: int, st: os.stat_result, trust_unreadable: bool) -> bool:
    """Tell whether process ``pid`` has the file ``st`` open.

    A reader without capabilities (gpuswapd as its unit runs it) may list another process's fds
    but not follow them: like an unreadable fd directory, that is trusted when asked to, as the
    real driver lists every process to any reader.
    """
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except PermissionError:
        return trust_unreadable
    except OSError:
        return False
    denied = False
    for n in names:
        try:
            s = os.stat(f"{fd_dir}/{n}")
        except PermissionError:
            denied = True
            continue
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            return True
    return denied and trust_unreadable


def holder_pid(lock_path: str | Path) -> int | None:
    """Return the PID (in this PID namespace) of the process holding ``lock_path``, if any."""
    try:
        st = os.stat(lock_path)
    except FileNotFoundError:
        return None
    same_inode = [(pid, dev) for pid, dev, ino in _flock_entries() if ino == st.st_ino]
    # The device in /proc/locks is the superblock's; stat() may differ (btrfs subvolumes).
    exact = [pid for pid, dev in same_inode if dev == st.st_dev]
    for pid in exact or [pid for pid, _ in same_inode]:
        if pid > 0 and _holds_open(pid, st, trust_unreadable=True):
            return pid
    # The locker is gone (or hidden) but the lock lives on in a process that inherited the fd.
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    return next((p for p in pids if _holds_open(p, st, trust_unreadable=False)), None)


def snapshot(directory: str | Path, card: int = 0) -> dict[str, Any]:
    """Reap, then report GPU ``card``'s total/used/free bytes and its holders (with their PIDs)."""
    return snapshot_cards(directory, [card])[0]


def snapshot_cards(directory: str | Path, cards: list[int] | None = None) -> list[dict[str, Any]]:
    """Reap once, then snapshot each of ``cards`` (default: every card), in that order."""
    directory = Path(directory)
    with _locked(directory) as state:
        _reap(directory, state, time.time())
        wanted = list(range(_cards(state))) if cards is None else cards
        for card in wanted:
            _check_card(state, card)
        out = []
        here = _namespace()
        for card in wanted:
            holders = []
            for key, h in sorted(state["holders"].items(), key=lambda kv: kv[1]["registered_at"]):
                if h.get("card", 0) != card:
                    continue
                pid = _pid_of(directory, state, key, h, here)
                name = key.split("~")[0]
                holders.append({"name": name, "pid": pid, "bytes": h["bytes"], "dead_at": h["dead_at"]})
            used = _used(state, card)
            total = int(state["total_bytes"])
            out.append({
                "total_bytes": total,
                "used_bytes": used,
                "free_bytes": total - used,
                "holders": holders,
            })
    return out


def set_cards(directory: str | Path, cards: int) -> None:
    """Give the ledger ``cards`` cards; dropping a card that still has live holders is an error."""
    with _locked(Path(directory)) as state:
        _set_cards(Path(directory), state, cards)


def ooms(directory: str | Path) -> list[dict[str, Any]]:
    """Return the out-of-memory records, oldest first."""
    with _locked(Path(directory)) as state:
        return list(state["ooms"])


def reset(directory: str | Path, cards: int | None = None, release_lag_s: float | None = None) -> None:
    """Forget the OOM records and every dead holder (lagging or not); live holders stay.

    With ``cards``, also give the ledger that many cards; with ``release_lag_s``, that release lag.
    """
    directory = Path(directory)
    with _locked(directory) as state:
        _reap(directory, state, time.time())
        state["holders"] = {k: h for k, h in state["holders"].items() if h["dead_at"] is None}
        state["ooms"] = []
        if cards is not None:
            _set_cards(directory, state, cards)
        if release_lag_s is not None:
            state["release_lag_s"] = release_lag_s


def set_lag(directory: str | Path, release_lag_s: float) -> None:
    """Set the release lag, in seconds (it applies at once, to memory already being freed too)."""
    if release_lag_s < 0:
        raise LedgerError("a release lag is not negative")
    with _locked(Path(directory)) as state:
        state["release_lag_s"] = release_lag_s


def _alive(pid: int, start: int) -> bool:
    """Tell whether the process ``pid`` that started at ``start`` (clock ticks since boot) still runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) == start and fields[0] != "Z"


def drive(directory: str | Path, every: float = 0.1, while_: tuple[int, int] | None = None) -> int:
    """Play the driver: read the ledger every ``every`` seconds, so each holder's PID here and each death are known.

    Ends when the directory goes, or when the process ``while_`` (PID, start time) is gone.
    """
    directory = Path(directory)
    while while_ is None or _alive(*while_):
        if not (directory / LEDGER).exists():
            return 0
        try:
            with _locked(directory) as state:
                _reap(directory, state, time.time())
        except (LedgerError, OSError, ValueError) as err:  # a ledger being made afresh
            print(f"ledger driver: {err}", file=sys.stderr, flush=True)
        time.sleep(every)
    return 0


def _process(text: str) -> tuple[int, int]:
    pid, _, start = text.partition(":")
    return int(pid), int(start)


def main(argv: list[str] | None = None) -> int:
    """Run the ledger CLI."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", dest="sub_dir", help=f"ledger directory (default ${ENV_DIR})")
    parser = argparse.ArgumentParser(description="simulated GPU VRAM ledger")
    parser.add_argument("--dir", help=f"ledger directory (default ${ENV_DIR})")
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init", parents=[common], help="create a fresh ledger")
    p_init.add_argument("--total", required=True, type=parse_size, help="e.g. 24GiB")
    p_init.add_argument("--lag", type=float, default=1.5, help="release lag in seconds")
    p_init.add_argument("--cards", type=int, default=1, help="how many cards (default 1)")
    p_show = sub.add_parser("show", parents=[common])
    p_show.add_argument("--card", type=int, default=0, help="which card (default 0)")
    sub.add_parser("ooms", parents=[common])
    p_reset = sub.add_parser("reset", parents=[common])
    p_reset.add_argument("--cards", type=int, help="also give the ledger this many cards")
    p_reset.add_argument("--lag", type=float, help="also set the release lag, in seconds")
    p_cards = sub.add_parser("cards", parents=[common], help="give the ledger N cards")
    p_cards.add_argument("count", type=int)
    p_lag = sub.add_parser("lag", parents=[common], help="set the release lag, in seconds")
    p_lag.add_argument("seconds", type=float)
    p_drive = sub.add_parser("driver", parents=[common], help="read every 0.1 s, as a driver knows its processes")
    p_drive.add_argument("--every", type=float, default=0.1, help="seconds between reads (default 0.1)")
    p_drive.add_argument("--while", dest="while_", type=_process, metavar="PID:START",
                         help="end when this process (PID and start time, in clock ticks) is gone")
    args = parser.parse_args(argv)
    try:
        directory = Path(args.sub_dir or args.dir) if (args.sub_dir or args.dir) else default_dir()
        if args.command == "init":
            init(directory, args.total, args.lag, args.cards)
        elif args.command == "show":
            print(json.dumps(snapshot(directory, args.card), indent=2))
        elif args.command == "ooms":
            print(json.dumps(ooms(directory), indent=2))
        elif args.command == "cards":
            set_cards(directory, args.count)
        elif args.command == "lag":
            set_lag(directory, args.seconds)
        elif args.command == "driver":
            return drive(directory, args.every, args.while_)
        else:
            reset(directory, args.cards, args.lag)
    except LedgerError as e:
        print(f"ledger: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
