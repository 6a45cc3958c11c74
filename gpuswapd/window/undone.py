"""Whether a window's stop was undone while no gpuswapd watched: the units that ran again since are their operator's.

A record read at a start can be older than the window it names: a state directory that failed
its writes kept a window gpuswapd had already closed, and its restore started the units; their
operator may have stopped them since, or they crashed, while gpuswapd was down. A unit that
became active after the window stopped it had its stop undone: what it is now is its operator's
(or systemd's), and it is not started.

This needs systemd to say what each unit is and since when. When it cannot (a read that hangs),
the record is judged again before its restore starts anything (``closing._restore``): the
restore waits in DEGRADED until systemd answers, rather than start what a crash stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuswapd.errors import GpuswapError
from gpuswapd.logs import log
from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord

if TYPE_CHECKING:
    from gpuswapd.adapters.unitstates import UnitState
    from gpuswapd.window.context import Context


async def judge(w: Context, rec: WindowRecord, found_in: Phase) -> str | None:
    """Leave to their operator the units this window stopped that ran again since and are down now.

    ``found_in``: the phase the record was read in at this start. Return None once judged, or what
    kept systemd from saying (then nothing changed, and the record is to be judged again).
    """
    if not rec.units or rec.stopped_mono is None:
        return None
    try:
        states = await w.resident.unit_states(list(rec.units))
    except GpuswapError as err:
        return err.message
    undone = [u for u, st in states.items() if st.active_enter is not None and st.active_enter > rec.stopped_mono
              and not st.active]
    failed = [u for u in undone if states[u].active_state == "failed"]
    restoring = found_in in (Phase.RESTORING, Phase.DEGRADED)
    if failed and (restoring or await _own_start_issued(w, rec, failed)) and not await _timers_resumed_since(w, rec):
        # Left restoring (or its restore's start recorded, the phase's write lost), it may have
        # started them itself before gpuswapd went: one that failed since (and what it took down
        # with it) is its own start that did not last: the restore goes on.
        # Not when the timers it paused run again since the stop: gpuswapd resumes them only once the
        # resident it restored has answered, so that restore ended (its last writes did not reach
        # the disk) and the failure is a crash since, its operator's and systemd's.
        undone = []
    if undone:
        undone = await _came_up_after_the_stop(w, undone, states)
    if undone:
        log.warning("resident_stop_undone_meanwhile", units=undone, window=rec.id,
                    consequence="left as they are: they ran again after this window stopped them")
        rec.units = [u for u in rec.units if u not in undone]
        await w.resident.unmark(undone)
        await w.resident.start_ended(undone)
    return None


async def _own_start_issued(w: Context, rec: WindowRecord, units: list[str]) -> bool:
    """Tell whether gpuswapd issued a restore's start of one of these units after this window's stop.

    Each restore's start is recorded just before its job (state/marks.py, ``starting``) and
    forgotten when the restore ends. When that record cannot be read, it says no.
    """
    try:
        issued = await w.resident.started_at()
    except GpuswapError:
        return False
    # The record keeps its restore's latest start (a retry's): the unit may have come up under an earlier one.
    return any((at := issued.get(u)) is not None and rec.stopped_mono is not None and at > rec.stopped_mono
               for u in units)


async def _came_up_after_the_stop(w: Context, units: list[str], states: dict[str, UnitState]) -> list[str]:
    """Keep the units that became active after gpuswapd's own mark of their stop, not merely after the record's time.

    The record's stop time is taken as the timers are paused, before the slot save (up to its
    deadline): a unit still starting then (its operator's start) came up before the stop itself.
    Its mark, written just before the stop job, is later than that: the stop is gpuswapd's own.
    When the marks cannot be read, the record's time stands.
    """
    try:
        marked = await w.resident.marked_at()
    except GpuswapError:
        return units
    return [u for u in units if marked.get(u) is None or (states[u].active_enter or 0.0) > (marked[u] or 0.0)]


async def _timers_resumed_since(w: Context, rec: WindowRecord) -> bool:
    """Tell whether every timer this window paused became active after its stop (False when it cannot be told)."""
    if not rec.timers or rec.stopped_mono is None:
        return False
    try:
        states = await w.resident.unit_states(list(rec.timers))
    except GpuswapError:
        return False
    return all(st.active and st.active_enter is not None and st.active_enter > rec.stopped_mono
               for st in states.values())
