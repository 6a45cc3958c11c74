"""The event bus: every log event, in one schema, for ``gpuswapctl watch``, the hooks and the metrics.

A structlog processor (``EventBus.tap``, installed by ``logs.setup_logging``) copies each event
at info level and above into the schema below and hands it to the subscribers on the event loop's
thread, in the order the events were logged, whichever thread logged them:

    {"event": "phase_entered", "window": "20250101-120000-abcdef", "phase": "BOOTING",
     "stage": "open", "elapsed_s": 12.5, "level": "info", "ts": 1735732812.5, ...the event's own keys}

``event`` is the structlog event name; ``window``, ``phase`` and ``stage`` come from the logging
context (the window driver binds them), else from the window as it stands; ``elapsed_s`` is the
seconds since the window opened. Lease events carry ``reason``, one of ``LEASE_END_REASONS``,
whatever the log line said (its own words move to ``detail``). A number that is not finite is
``null``: a lease "for infinity" has ``"duration_s": null`` and ``"expires_at": null``, meaning
until it is released (JSON has no Infinity; ``jq`` and most parsers reject it).

Subscribers run on the event loop and must not block or await: they queue, count or spawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from gpuswapd import clock
from gpuswapd.logs import log
from gpuswapd.protocol import JsonObject

Event = JsonObject
Subscriber = Callable[[Event], None]

LEASE_END_REASONS = ("released", "expired", "unit_gone", "closed", "preempted")
_LEASE_ENDS = {"lease_released": "released", "lease_expired": "expired", "lease_preempted": "preempted"}

# The events a hook may name (hooks.events): what gpuswapd logs, but for the hooks' own events (a
# hook run for a hook's failure could run forever). tests/unit/test_events.py checks that each is
# logged somewhere in the package, except those of PLANNED.
KNOWN_EVENTS = frozenset({
    "accept_out_of_resources", "acquire_withdrawn", "adopt_without_docker", "baseline_restore", "baseline_unknown",
    "client_dropped_unread", "client_handler_crashed", "clients_refused", "degraded", "docker_unavailable_at_start",
    "engine_canary_failed", "engine_exited", "engine_failed", "engine_health_unanswered", "engine_not_parked",
    "engine_parked", "engine_pids_unknown", "engine_recovered", "engine_restart_failed", "engine_restarted",
    "engine_sleep_unavailable", "engine_started", "engine_stopped", "engine_take_down_failed",
    "engine_take_down_pending", "engine_verified", "engine_wake_failed", "engine_warmup", "engine_watch_lost",
    "engine_watch_restarted", "engine_woken", "fit_unsure", "forced_exit", "gpuswapd_ready", "gpuswapd_stopped",
    "history_unreadable", "late_calls_pending", "late_calls_reconciled", "lease_ended", "lease_expired",
    "lease_granted", "lease_released", "lease_renewed", "orphan_check_failed", "orphan_engine_removed",
    "orphan_sweep_failed", "outside_call_hung", "outside_call_returned", "park_level_lowered",
    "parked_engine_adopted", "parked_engine_dropped", "parked_engine_not_removed", "parked_engine_removed",
    "parked_engine_room_unknown", "parked_engine_without_docker", "parked_state_unreadable", "peer_mismatch",
    "phase_entered", "preempted", "preempted_unit_not_stopped", "preempted_unit_stopping_again", "preempting",
    "preemption_abandoned", "preemption_yielded",
    "preemptor_refused", "queue_kept_for_reclaim", "lease_kept_for_reclaim", "lease_reclaimed",
    "reconcile_failed", "recovered", "request_crashed", "request_queued",
    "resident_as_it_was", "resident_baseline_recorded", "resident_busy_proceeding", "resident_changed",
    "resident_cache_files_left", "resident_cache_files_removed", "resident_cache_not_restored",
    "resident_cache_not_saved", "resident_cache_restored", "resident_cache_saved", "resident_cache_slots_skipped",
    "resident_crashed_since_restore", "resident_down", "resident_down_at_exit", "resident_down_since_found_up",
    "resident_first_seen_beside_parked", "resident_reconfigured_beside_parked",
    "resident_restart_failed",
    "resident_restarting_crashed",
    "resident_up", "stopped_record_cleared_at_exit", "stopped_record_left_at_exit", "stopped_record_not_cleared",
    "stopped_record_stale", "resident_stop_undone_meanwhile",
    "resident_stop_never_issued",
    "resident_stop_unchecked", "stopped_record_unreadable",
    "resident_file_skipped", "resident_footprint_larger", "resident_found_down",
    "resident_held_down",
    "resident_hold_lifted", "resident_identity_unread",
    "resident_left_masked", "resident_left_stopped", "resident_names_unread", "resident_idle_probe_unanswered",
    "resident_prefetch_failed", "resident_prefetch_skipped", "resident_prefetched", "resident_restored_smaller",
    "resident_state_unreadable", "resident_still_smaller", "resident_unverified", "resident_verified",
    "restore_failed",
    "shutdown_bound_reached",
    "state_migrated", "state_not_saved_at_exit", "state_not_saved_carrying_on", "state_not_set_aside",
    "state_read_failed", "state_set_aside", "state_unreadable", "state_writable_again", "state_write_failed",
    "stopping", "system_stopping_window_kept", "task_failed", "timers_paused", "timers_resume_failed",
    "timers_resume_retry", "timers_resumed", "units_started", "units_stopped", "vram_free",
    "vram_held_after_bare_window", "vram_not_free_at_close", "vram_not_free_restoring_anyway",
    "vram_unknown_before_restore",
    "vram_unknown_restoring_anyway", "vram_wait_ended",
    "watcher_dropped", "window_abandoned", "window_adopted", "window_driver_failed",
    "engine_verified_on_adoption", "engine_unverified_on_adoption",
    "window_driver_interrupted", "window_failed", "window_finished", "window_left_for_next_start",
    "window_open_crashed", "window_recovering", "window_stale", "window_switching",
    # Before an engine boots (gpuswapd.checks.bootchecks): its compile caches and the known-bad table.
    "compile_cache_not_kept", "known_bad_allowed", "known_bad_setting",
    # Time and names: how naps follow a suspend (naps.py), a socket group the group database did not resolve.
    "durations_on_boottime", "daemon_time_continued", "resume_unwatched", "socket_group_unresolved",
})
PLANNED: frozenset[str] = frozenset()  # named by the design, not logged yet
# Logged, but no event for hooks or watchers: a hook's own outcome (a hook for it would loop), the
# metrics' own housekeeping, and a client that hung up.
INTERNAL = frozenset({"client_dropped", "hook_dropped", "hook_failed", "hook_ran", "hook_timed_out",
                      "metrics_listening", "metrics_request_crashed", "metrics_textfile_failed",
                      "metrics_textfile_written_again", "metrics_window_not_observed",
                      "peer_not_the_unit"})

_CONTEXT_KEYS = frozenset({"window_id", "window", "phase", "stage", "elapsed_s", "event", "exc_info", "stack_info"})
_LEVELS = {"exception": "error", "critical": "critical", "error": "error", "warning": "warning", "warn": "warning",
           "info": "info", "msg": "info"}
_OWN_FAILURE = "event_subscriber_failed"


def _plain(value: Any) -> Any:
    """Make a value JSON-safe: numbers, strings, lists and tables as they are, the rest as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None  # a lease for infinity: until released (JSON has no Infinity)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def lease_end_reason(name: str, fields: Mapping[str, Any]) -> str | None:
    """Name why a lease ended (one of LEASE_END_REASONS), or None if the event ends no lease."""
    if name in _LEASE_ENDS:
        return _LEASE_ENDS[name]
    if name == "lease_ended":
        reason = fields.get("reason")
        return reason if reason in LEASE_END_REASONS else "closed"
    return None


def to_event(name: str, level: str, fields: Mapping[str, Any], context: Mapping[str, Any]) -> Event:
    """Build the schema's event from a log event's fields (``context``: the window as it stands)."""
    window = fields.get("window") or fields.get("window_id") or context.get("window")
    out: Event = {
        "event": name,
        "window": window,
        "phase": fields.get("phase") or context.get("phase"),
        "stage": fields.get("stage") or context.get("stage"),
        "elapsed_s": fields.get("elapsed_s", context.get("elapsed_s")),
        "level": level,
        "ts": round(clock.wall(), 3),
    }
    for key, value in fields.items():
        if key not in _CONTEXT_KEYS and not key.startswith("_"):
            out[key] = _plain(value)
    reason = lease_end_reason(name, fields)
    if reason is not None:
        said = fields.get("reason")
        if said is not None and said != reason:
            out["detail"] = _plain(said)
        out["reason"] = reason
    return out


class EventBus:
    """Copies log events into the schema and hands them to subscribers on the event loop."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        # What the logging context may lack (a client's lease has no window bound): the window now.
        self.context: Callable[[], Mapping[str, Any]] = dict

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver on ``loop`` (call from its thread); events logged before are not delivered."""
        self._loop, self._thread = loop, threading.get_ident()

    def detach(self) -> None:
        """Stop delivering (the loop is going away)."""
        self._loop, self._thread = None, None

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Add a subscriber; return the function that removes it."""
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(subscriber)

        return unsubscribe

    @property
    def subscribers(self) -> int:
        """Count the subscribers."""
        return len(self._subscribers)

    def tap(self, _logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        """Copy a log event onto the bus (a structlog processor: it passes the event on unchanged)."""
        loop = self._loop
        level = _LEVELS.get(method)
        name = event_dict.get("event")
        if loop is None or not self._subscribers or level is None or not isinstance(name, str) or name == _OWN_FAILURE:
            return event_dict
        try:
            event = to_event(name, level, event_dict, self.context())
        except Exception:  # a log call must never fail because of the bus
            return event_dict
        with contextlib.suppress(RuntimeError):  # the loop is closed: gpuswapd is exiting
            if threading.get_ident() == self._thread:
                loop.call_soon(self._dispatch, event)
            else:
                loop.call_soon_threadsafe(self._dispatch, event)
        return event_dict

    def publish(self, event: Event) -> None:
        """Hand an event to every subscriber now (on the loop's thread)."""
        self._dispatch(event)

    def _dispatch(self, event: Event) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber(event)
            except Exception as err:  # one subscriber's bug must not starve the others
                log.exception(_OWN_FAILURE, subscriber=repr(subscriber), error=repr(err), on=event.get("event"))
