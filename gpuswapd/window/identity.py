"""What the resident is, and proof that every restore brings it back so: its context, slots and models.

llama.cpp's llama-server fits itself to the memory it finds (``--fit``, on by default): started
short, it shrinks its context and says nothing. An answered completion proves only that it
serves, so after each restore's verify gpuswapd reads what the resident is (``GET /props`` for
``resident.server = "llama.cpp"``, ``GET /v1/models`` for every server) and compares it with its
baseline, what it was when all was well:

- The baseline is recorded at start (the resident healthy, no window open) and after every
  restore whose resident is as it was (or larger), in the state document, with the VRAM its
  processes held then.
- A restore that finds it smaller (its context, its slots, a model gone) logs ``resident_changed``
  and repairs it: a parked engine is removed, the resident stopped, the memory its baseline held
  (or ``gpu.resident_needs``, whichever is larger) waited for, with every exited process's, and
  the resident started, verified and compared once more.
- Still smaller: the window ends *restored, smaller*. The resident serves and the timers resume
  (nothing is stuck: this is not DEGRADED); status and history carry ``resident_changed``, a
  warning names the numbers, what holds the memory and the key to raise, the gauge
  ``gpuswapd_resident_degraded`` is 1, and the next close tries again.

Before a window stops the resident, what its processes hold on the card is its footprint: larger
than ``gpu.resident_needs``, it is warned of once and used instead for every later check, the
park decision included (``Known.needs``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuswapd import clock
from gpuswapd.errors import BadResponse, Degraded, GpuswapError
from gpuswapd.logs import log
from gpuswapd.parts.vram import Holder
from gpuswapd.protocol import JsonObject
from gpuswapd.record import WindowRecord
from gpuswapd.retry import backoff
from gpuswapd.sizes import format_size
from gpuswapd.tasks import sleep_unless
from gpuswapd.window import parking
from gpuswapd.window.baseline import Identity, smaller

if TYPE_CHECKING:
    from gpuswapd.window.context import Context

Pause = Callable[[float], Awaitable[None]]
POLL_S = 0.25
READ_FOR_S = 30.0
WARN_AFTER = 5  # tries at start before an unanswered /props is warned of (it may still be loading)
WINDOW_LOOK_S = 2.0  # no baseline yet and a window open at start (a baseline restore): looked at again this often


# -- reading it -----------------------------------------------------------------------------------


async def read(w: Context, units: list[str]) -> Identity:
    """Read what the resident is now, and what the processes of ``units`` hold on the card."""
    props, models = await w.resident.what_it_is()
    held = await _held(w, units)
    config, invocation = await w.resident.how_it_runs()
    return Identity(props.n_ctx if props else None, props.slots if props else None,
                    props.model_path if props else None, props.alias if props else None, tuple(models),
                    None if held is None else sum(h.used_bytes for h in held), tuple(held or ()), clock.now(),
                    config, invocation)


def last_seen(w: Context) -> str | None:
    """Return the resident's InvocationID as gpuswapd last saw it (its baseline, or what the last close left)."""
    changed = w.known.changed
    now = changed.get("now") if changed is not None else None
    if isinstance(now, dict) and now.get("invocation"):
        return str(now["invocation"])
    return w.known.baseline.invocation if w.known.baseline is not None else None


async def _held(w: Context, units: list[str]) -> list[Holder] | None:
    """List the card's processes that belong to ``units`` (None: the card cannot be read)."""
    try:
        reading = await w.vram.read(processes=True)
    except GpuswapError:
        return None
    if reading is None:
        return None
    held = []
    for proc in reading.processes:
        unit = await w.vram.unit_of(proc.pid)
        if unit is not None and unit in units:
            held.append(Holder(proc.pid, proc.used_bytes, unit))
    return held


async def _others(w: Context, units: list[str]) -> list[Holder]:
    """List what processes outside ``units`` hold on the card now, largest first."""
    try:
        reading = await w.vram.read(processes=True)
    except GpuswapError:
        return []
    if reading is None:
        return []
    out = []
    for proc in sorted(reading.processes, key=lambda p: -p.used_bytes):
        unit = await w.vram.unit_of(proc.pid)
        if unit is None or unit not in units:
            out.append(Holder(proc.pid, proc.used_bytes, unit))
    return out


async def learn_footprint(w: Context, running: list[str]) -> None:
    """Before a window stops the resident, learn what its processes hold; warn once if more than it is said to need.

    With no baseline yet (its state document could not be read, and it was not serving at
    start), the resident as it runs now, as its operator left it, is the baseline: the first
    restore gpuswapd sees may come back beside a parked engine, fitted into less.
    """
    if w.known.baseline is None and set(w.config.resident.units) <= set(running):
        try:
            _record(w, await read(w, running), "the resident as it ran before the first window gpuswapd saw")
        except GpuswapError as err:
            log.info("resident_identity_unread", error=err.message,
                     consequence="the window's restore records the baseline")
    elif set(w.config.resident.units) <= set(running):
        await _follow_operator(w, running)
    held = await _held(w, running)
    if not held:
        return  # no probe, or nothing listed under its units (a resident off the card)
    footprint = sum(h.used_bytes for h in held)
    configured = w.config.gpu.resident_needs
    w.known.footprint = footprint  # recorded by the write that enters STOPPING_RESIDENT
    if footprint > configured and footprint > w.known.warned:
        w.known.warned = footprint
        log.warning("resident_footprint_larger", footprint=format_size(footprint),
                    resident_needs=format_size(configured), held="; ".join(h.describe() for h in held),
                    consequence=f"gpuswapd counts {format_size(footprint)} for the resident from now on (the park "
                                "decision too); raise gpu.resident_needs to at least that")


async def _follow_operator(w: Context, running: list[str]) -> None:
    """Before a window stops it, take as the baseline a resident its operator reconfigured since gpuswapd last saw it.

    Seen only at the close, the change would be compared with what the restore brought back, which
    may be fitted into less beside a parked engine: that would be taken for the operator's wish.
    """
    was = w.known.baseline
    try:
        config = await w.resident.runs_as()
    except GpuswapError:
        return  # systemd cannot say now: the close compares, as before
    if was is None or not replace(was, config=config).reconfigured(was):  # (the one test of an operator's change)
        return
    try:
        _record(w, await read(w, running), "its operator changed how it runs (seen before a window stopped it)")
    except GpuswapError as err:
        log.info("resident_identity_unread", error=err.message,
                 consequence="the window's restore compares it with the baseline it has")


# -- after a restore's verify -----------------------------------------------------------------------


async def _read_within(w: Context, units: list[str], pause: Pause) -> Identity | None:
    """Read it, retrying a server that does not answer yet, a while; None: unread.

    The resident has just answered a completion: a /props that does not answer within
    ``READ_FOR_S`` (or ``resident.verify.timeout``, if shorter) is a wrong URL, not a slow server.
    """
    deadline = clock.monotonic() + min(READ_FOR_S, w.config.resident.verify.timeout)
    attempt = 0
    while True:
        try:
            return await read(w, units)
        except GpuswapError as err:
            attempt += 1
            delay = backoff(w.backoffs.restore, attempt)
            # A wrong answer (a wrong URL, not llama-server) will not heal by asking again.
            if isinstance(err, BadResponse) or clock.monotonic() + delay > deadline:
                log.warning("resident_identity_unread", error=err.message,
                            consequence="the resident is not compared with its baseline this time; check "
                                        "resident.props_url and resident.verify.url (the next close tries again)")
                return None
            await pause(delay)


def _record(w: Context, now: Identity, why: str) -> None:
    """Make ``now`` the baseline (and clear a change it makes good).

    How its operator runs it (the digest of ExecStart= and Environment=) that systemd did not say
    this time stays what it said last: a baseline without it could never tell their change from
    llama.cpp's fitting, and every smaller restore would go unrepaired.
    """
    known, was = w.known, w.known.baseline
    if now.config is None and was is not None and was.config is not None:
        now = replace(now, config=was.config)
    known.baseline = now
    if was is None or not now.same_as(was) or was.held_bytes != now.held_bytes:
        log.info("resident_baseline_recorded", resident=now.describe(), held=_size(now.held_bytes), why=why)
    if known.changed is not None:
        known.changed = None
        log.info("resident_as_it_was", resident=now.describe())
    w.writer.request()


async def after_verify(w: Context, rec: WindowRecord, repaired: bool, pause: Pause) -> bool:
    """Compare the resident just verified with its baseline; False: it is smaller and a repair comes first."""
    now = await _read_within(w, rec.units, pause)
    if now is None:
        rec.restored = "unchecked"
        _started_here(w, (await w.resident.how_it_runs())[1])
        return True
    was, server = w.known.baseline, w.config.resident.server
    if was is None:
        if not repaired and w.parked is not None:
            # No baseline to compare with (the state that held it was lost), and the resident came
            # back fitted into what the parked engine left: taken as it is, a squeezed resident
            # would be its baseline, and never repaired. Measured with the room it has alone.
            log.warning("resident_first_seen_beside_parked", now=now.describe(), parked=w.parked.container.name,
                        next="the parked engine is removed and the resident started again with the card to "
                             "itself, so that its baseline is what it runs alone")
            return False
        _record(w, now, "the first restore gpuswapd saw")
        rec.restored = "as_it_was"
        return True
    if now.reconfigured(was):
        if not repaired and w.parked is not None and smaller(now, was, server):
            # Its operator's change, first seen here, came back beside gpuswapd's parked engine: what
            # of it is their wish and what llama.cpp's fitting into less cannot be told. Measured
            # again with the room it had, what comes back is theirs.
            log.warning("resident_reconfigured_beside_parked", was=was.describe(), now=now.describe(),
                        parked=w.parked.container.name,
                        next="the parked engine is removed and the resident started again with the room it had, "
                             "so that its new baseline is what its operator configured")
            return False
        # Its operator changed how it runs (a smaller context on purpose, say): that is no repair's to undo.
        _record(w, now, "its operator changed how it runs (ExecStart=, Environment=, a drop-in)")
        rec.restored = "as_it_was"
        return True
    short = smaller(now, was, server)
    if short and (now.config is None or was.config is None):
        # Whether its operator changed how it runs cannot be told: a repair could undo their change.
        log.warning("resident_identity_unread",
                    error="systemd did not say how the resident runs (its units' ExecStart= and Environment=)",
                    consequence="a smaller resident is not repaired this time (its operator may have changed it); "
                                "the next close compares it again")
        rec.restored = "unchecked"
        _started_here(w, now.invocation)
        return True
    if not short:
        if rec.resident_changed is not None:
            rec.resident_changed = {**rec.resident_changed, "repaired": True, "after": now.to_dict()}
        _record(w, now, "a restore found it as it was")
        rec.restored = "as_it_was"
        return True
    change: JsonObject = {"was": was.to_dict(), "now": now.to_dict(), "smaller": short, "repaired": False, "at": now.at}
    if not repaired:
        log.warning("resident_changed", was=was.describe(), now=now.describe(), smaller="; ".join(short),
                    next="the resident is started again with the room it had at its baseline")
        rec.resident_changed = change
        await w.persist(required=False)
        return False
    others = await _others(w, rec.units)
    message = _restored_smaller(w, was, now, short, others)
    rec.resident_changed = {**change, "holders": [{"pid": h.pid, "unit": h.unit, "bytes": h.used_bytes}
                                                  for h in others], "message": message}
    rec.restored = "smaller"
    w.known.changed = {**rec.resident_changed, "window": rec.id}
    log.warning("resident_restored_smaller", error=message)
    w.writer.request()
    return True


def _started_here(w: Context, invocation: str | None) -> None:
    """Remember the InvocationID of a resident gpuswapd restored but did not compare with its baseline.

    Else the idle reconcile would take gpuswapd's own start for its operator's restart (an
    InvocationID it had not seen), and make what came back, fitted into less beside a parked engine,
    the baseline. None (systemd did not say) is never taken for a restart.
    """
    known = w.known
    if known.baseline is not None and known.baseline.invocation != invocation:
        known.baseline = replace(known.baseline, invocation=invocation)
        w.writer.request()
    now = known.changed.get("now") if known.changed is not None else None
    if known.changed is not None and isinstance(now, dict) and now.get("invocation") != invocation:
        known.changed = {**known.changed, "now": {**now, "invocation": invocation}}
        w.writer.request()


def _restored_smaller(w: Context, was: Identity, now: Identity, short: list[str], others: list[Holder]) -> str:
    """Say for a person what came back, what holds the memory, and the next step."""
    held = "; ".join(h.describe() for h in others) or "no other process"
    text = (f"the resident came back smaller than its baseline, even after a restart with the room it had: "
            f"{'; '.join(short)}; it holds {_size(now.held_bytes)} (at its baseline {_size(was.held_bytes)}); "
            f"held on the card besides it: {held}")
    if now.models != was.models and not any(s.startswith(("n_ctx", "total_slots")) for s in short):
        return text + "; check the resident's own configuration (it serves other models now); it serves meanwhile"
    configured = w.config.gpu.resident_needs
    return (text + f"; stop those processes, or raise gpu.resident_needs (now {format_size(configured)}) to what the "
            f"resident needs free to load as it was (the {_size(was.held_bytes)} it held, and llama.cpp's "
            "--fit-target margin, 1 GiB by default), so that gpuswapd waits for it; it serves meanwhile, and the next "
            "window's close tries again")


def _size(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else format_size(nbytes)


async def make_room(w: Context, rec: WindowRecord, pause: Pause) -> None:
    """Repair a smaller resident's room: remove a parked engine, stop the resident, wait for its memory."""
    parked = w.parked.container.name if w.parked is not None else None  # (a failed removal may forget it)
    if parked is not None and not await parking.remove(w, "the resident came back smaller beside it"):
        raise Degraded(f"the resident came back smaller beside the parked engine {parked}, "
                       "which could not be removed yet: see the log (journalctl -u gpuswapd); gpuswapd keeps trying")
    # A stop of gpuswapd's own again: recorded before it, so that a start after a SIGKILL meanwhile
    # does not take the units, down by this stop, for stopped by their operator (recovery).
    rec.stopped_mono = clock.kernel_monotonic()
    await w.persist(required=False)
    await w.resident.stop(rec.units)
    was = w.known.baseline
    need = max(w.resident_needs, (was.held_bytes or 0) if was is not None else 0)
    deadline = clock.monotonic() + w.config.gpu.release_timeout
    while True:
        # Free enough, and nothing that exited (the engine, the resident's own processes) still listed.
        try:
            reading = await w.vram.read(processes=True)
        except GpuswapError as err:
            log.warning("vram_unknown_before_restore", error=err.message, attempt=1)
            return
        if reading is None:
            return
        exited = [p for p in reading.processes if await w.vram.unit_of(p.pid) is None]
        if reading.free_bytes >= need and not exited:
            log.info("vram_free", free=format_size(reading.free_bytes), need=format_size(need))
            return
        if clock.monotonic() >= deadline:
            log.warning("vram_not_free_restoring_anyway",
                        error=await w.vram.describe_shortfall(reading, need, w.config.gpu.release_timeout))
            return
        await pause(POLL_S)


# -- while no window is open ---------------------------------------------------------------------------


async def record_at_start(w: Context) -> None:
    """Record the baseline at start once the resident serves while no window is open.

    A window open at start (one adopted, a baseline restore after unreadable state) compares and
    records it at its restore when a baseline is known; when none is (the state document that held
    it could not be read), it is recorded here once that window is over.
    """
    attempt = 0
    units = w.config.resident.units
    while not w.stopping.is_set():
        if w.record is not None or len(w.queue):
            if w.known.baseline is not None:
                return  # a window's restore compares and records it
            await sleep_unless(w.stopping, WINDOW_LOOK_S)
            continue
        try:
            running = await w.resident.closure()
            if set(units) <= set(running):
                now = await read(w, running)
                if w.record is None:
                    _at_start(w, now)
                    return
                continue  # a window opened meanwhile: its restore records it, or this loop once it is over
        except GpuswapError as err:
            if attempt + 1 == WARN_AFTER:
                log.warning("resident_identity_unread", error=err.message,
                            consequence="no baseline of the resident yet (asked again until it answers): check "
                                        "resident.props_url and resident.verify.url")
        attempt += 1
        await sleep_unless(w.stopping, backoff(w.backoffs.restore, attempt))


def _at_start(w: Context, now: Identity) -> None:
    """Take what runs at start as the baseline, unless the last close left it smaller and it still is.

    Another model file or alias is its operator's change, never llama.cpp's fitting: it is taken.
    """
    was, seen = w.known.baseline, last_seen(w)
    same_model = was is not None and (now.model_path, now.alias) == (was.model_path, was.alias)
    # Restarted by someone else than gpuswapd since (a new InvocationID), or reconfigured: its operator's.
    operators = was is not None and (now.reconfigured(was) or bool(now.invocation and seen and now.invocation != seen))
    if w.known.changed is not None and was is not None and same_model and not operators \
            and smaller(now, was, w.config.resident.server):
        log.warning("resident_still_smaller", now=now.describe(), was=was.describe(),
                    consequence="the baseline stays as it was; the next window's close tries again")
        return
    _record(w, now, "gpuswapd started with the resident serving")


async def recheck(w: Context, invocation: str | None = None) -> None:
    """While idle, follow the resident: one left smaller may be back as it was; one restarted by someone else is theirs.

    ``invocation``: its first unit's InvocationID now. Another than gpuswapd last saw means its
    operator (or systemd's ``Restart=``) started it: what runs now becomes the baseline.
    """
    was, seen = w.known.baseline, last_seen(w)
    restarted = bool(invocation and seen and invocation != seen)
    if was is None or w.record is not None or (w.known.changed is None and not restarted):
        return
    running = await w.resident.closure()
    if not set(w.config.resident.units) <= set(running):
        return
    now = await read(w, running)
    if w.record is not None:
        return
    if restarted or now.reconfigured(was):
        _record(w, now, "its operator restarted or reconfigured it")
    elif not smaller(now, was, w.config.resident.server):
        _record(w, now, "the reconcile found it as it was")
