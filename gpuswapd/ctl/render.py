"""What gpuswapctl prints for people: phase progress, status, plan."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

from gpuswapd.timespan import format_span


class Progress:
    """Show the window's phases: a live line with elapsed time on a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool = True, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self._phase: str | None = None
        self._base = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._ticker: threading.Thread | None = None

    def event(self, event: dict[str, Any]) -> None:
        """Take one event from gpuswapd."""
        if self.enabled and event.get("event") == "queued":
            with self._lock:
                self.stream.write(f"gpuswapctl: {queued_line(event)}\n")
                self.stream.flush()
            return
        if self.enabled and event.get("event") == "waiting":
            with self._lock:
                self.stream.write(f"gpuswapctl: waiting: {event.get('reason')} (window {event.get('window')} in "
                                  f"{event.get('phase')})\n")
                self.stream.flush()
            return
        if not self.enabled or event.get("event") != "phase":
            return
        with self._lock:
            # Elapsed time is the window's, so a client that joins late shows the true age.
            self._base = time.monotonic() - float(event.get("elapsed_s", 0.0))
            if self.tty and self._phase is not None:
                self._line(final=True)
            self._phase = str(event["phase"])
            if not self.tty:
                self.stream.write(f"gpuswapctl: {self._phase} (at {event.get('elapsed_s', 0):.1f}s)\n")
                self.stream.flush()
        if self.tty and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def _line(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self._base
        end = "\n" if final else ""
        self.stream.write(f"\r\033[K{'✓' if final else '…'} {self._phase:<18} {elapsed:6.1f}s{end}")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._done.wait(0.2):
            with self._lock:
                self._line()

    def close(self) -> None:
        """Finish the live line."""
        self._done.set()
        if self.tty and self._phase is not None:
            with self._lock:
                self._line(final=True)


def queued_line(entry: dict[str, Any]) -> str:
    """Say where a queued request stands: position, profile, waited, ETA."""
    eta = entry.get("eta_s")
    eta_text = (f"ETA {format_span(round(eta))}" if isinstance(eta, (int, float))
                else "ETA unknown (no window of it yet)")
    opened = entry.get("open")
    behind = f", behind window {opened['window']} ({opened['profile']}, {opened['phase']})" if opened else ""
    return (f"queued for profile {entry.get('profile')}: position {entry.get('position')}, waited "
            f"{format_span(round(entry.get('waited_s') or 0))}, {eta_text}{behind}")


def _seconds(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.1f}s"


def schedule_lines(reply: dict[str, Any]) -> list[str]:
    """Say what the schedule stands at, and each profile's price of a swap (medians of recent windows)."""
    lines: list[str] = []
    schedule = reply.get("schedule")
    if schedule:
        queue = ", ".join(f"{p} {n}" for p, n in (schedule.get("queue") or {}).items()) or "empty"
        left = schedule.get("residency_left_s")
        residency = (f"; {schedule.get('next')} takes the card in {format_span(max(1, round(left)))} at most "
                     f"(share {format_span(max(1, round(schedule.get('share_s') or 0)))})"
                     if isinstance(left, (int, float)) else "")
        lines.append(f"tenant: {schedule.get('tenant')}; waiting per profile: {queue}{residency}; swaps avoided "
                     f"{schedule.get('swaps_avoided', 0)}")
    for name, price in (reply.get("price") or {}).items():
        if not price.get("windows"):
            continue
        lines.append(f"price of a swap, profile {name}: open {_seconds(price.get('open_s'))} (boot "
                     f"{_seconds(price.get('boot_s'))}, wake {_seconds(price.get('wake_s'))}), close "
                     f"{_seconds(price.get('close_s'))}, resident restart {_seconds(price.get('resident_restart_s'))}"
                     f" (of {price['windows']} window{'s' if price['windows'] != 1 else ''})")
    return lines


def _left(lease: dict[str, Any]) -> str:
    if lease["remaining_s"] is None:
        return "until released"
    return f"{format_span(round(lease['remaining_s']))} left"


def _ago(ts: float | None) -> str:
    return "-" if ts is None else f"{format_span(round(max(0.0, time.time() - ts)))} ago"


def _timings(window: dict[str, Any]) -> str:
    return "  ".join(f"{t['phase']} {t['took_s']:.2f}s" for t in window["timings"] if "took_s" in t)


def print_status(reply: dict[str, Any], out: TextIO = sys.stdout) -> None:
    """Print the window's phase, leases and the last window."""
    window = reply.get("window")
    out.write(f"phase: {reply['phase']}\n")
    baseline = reply.get("baseline_restore")
    if baseline:
        out.write(f"baseline restored {_ago(baseline['at'])}: {baseline['reason']}\n")
    if reply.get("state_writable") is False:
        out.write(f"STATE NOT WRITABLE: {reply.get('state_error')}\n")
    for system, lane in (reply.get("hung") or {}).items():
        for call in lane.get("hung", []):
            out.write(f"hung: {system} {call['call']} for {call['for_s']:.0f}s\n")
    if window:
        kind = f", {window['kind']}" if window.get("kind", "engine") != "engine" else ""
        switched = f", switched from {window['switched_from']}" if window.get("switched_from") else ""
        out.write(f"window: {window['id']} (profile {window.get('profile', 'default')}{kind}{switched}) opened "
                  f"{_ago(window['opened_at'])}\n")
        if window.get("degraded"):
            out.write(f"DEGRADED: {window['degraded']}\n")
        if window.get("error"):
            out.write(f"error: {window['error']['message']}\n")
        for lease in window["leases"]:
            bound = ", ends with its connection" if lease.get("bind") == "connection" else ""
            out.write(f"  lease {lease['id']}  {lease['holder']:<30} {_left(lease)}{bound}\n")
        back = reply.get("resident_back")
        if back:
            out.write(f"resident back in about {format_span(max(1, round(back['in_s'])))}\n")
    if reply.get("waiting"):
        out.write(f"waiting: {reply['waiting']} acquire(s)\n")
    for entry in reply.get("queue") or []:
        eta = entry.get("eta_s")
        out.write(f"  queued {entry['position']}: {entry['holder']:<30} profile {entry['profile']}, waited "
                  f"{format_span(round(entry['waited_s']))}, ETA "
                  f"{format_span(round(eta)) if isinstance(eta, (int, float)) else 'unknown'}\n")
    for name, profile in (reply.get("profiles") or {}).items():
        endpoint = profile.get("endpoint")
        where = endpoint["url"] if endpoint else f"the bare card (CUDA_VISIBLE_DEVICES={profile.get('gpu_index')})"
        out.write(f"profile {name}: {profile['kind']}, needs {profile['needs']}, {where}\n")
    for name, boots in (reply.get("boots") or {}).items():
        took = ", ".join(f"{b:.1f}s" for b in boots["last_s"])
        out.write(f"boot to healthy, profile {name}: last {took}; longest {boots['longest_s']:.1f}s "
                  f"(of {boots['count']} boot{'s' if boots['count'] != 1 else ''})\n")
    for line in schedule_lines(reply):
        out.write(line + "\n")
    out.write(f"parked: {parked_line(reply.get('parked'))}\n")
    resident = reply.get("resident") or {}
    baseline = resident.get("baseline")
    if baseline:
        ctx = f"n_ctx {baseline['n_ctx']} x {baseline['slots']} slots, " if baseline.get("n_ctx") is not None else ""
        out.write(f"resident baseline: {ctx}models {', '.join(baseline.get('models') or []) or '(none)'}\n")
    changed = resident.get("changed")
    if changed:
        out.write(f"RESIDENT SMALLER: {changed.get('message') or '; '.join(changed.get('smaller') or [])}\n")
    last = reply.get("last")
    if last:
        out.write(f"last window: {last['id']} {last.get('outcome')} {_ago(last.get('closed_at'))}\n")
        if last.get("error"):
            out.write(f"  error: {last['error']['message']} (in {last['error'].get('phase')})\n")
        out.write(f"  {_timings(last)}\n")


def parked_line(parked: dict[str, Any] | None) -> str:
    """Say what is parked (the next open is warm) or that nothing is (the next open is cold)."""
    if not parked:
        return "nothing (the next window boots its engine cold)"
    left = format_span(round(max(0.0, parked["expires_at"] - time.time())))
    return (f"{parked['container']} asleep at level {parked['level']} since {_ago(parked['since'])}, holding "
            f"{parked['residual']}; the next window wakes it (removed if unused for {left} more)")


def print_plan(plan: dict[str, Any], out: TextIO = sys.stdout) -> None:
    """Print what a window would do now."""
    out.write(f"stop units:    {', '.join(plan['units']) or '(none active)'}\n")
    out.write(f"pause timers:  {', '.join(plan['timers']) or '(none)'}\n")
    if plan["jobs_running"]:
        out.write(f"jobs running:  {', '.join(plan['jobs_running'])} (the window waits for them)\n")
    if plan["resident_busy"]:
        out.write(f"resident busy: {plan['resident_busy']}\n")
    out.write(f"profile:       {plan.get('profile', 'default')} ({plan.get('kind', 'engine')})\n")
    c = plan["container"]
    if c is None:
        out.write("container:     none (a bare window: the card is handed over once it is free)\n")
    else:
        out.write(f"container:     {c['name']} from {c['image']} "
                  f"({'created per window' if c['create'] else 'existing'})\n")
    start = plan.get("next_open", "cold")
    out.write(f"next open:     {start}" + (f" ({plan['parked']})" if plan.get("parked") else "") + "\n")
    vram = plan.get("vram")
    if vram:
        out.write(f"VRAM:          {vram['free']} free of {vram['total']} now; "
                  f"{vram.get('free_after_stop', '?')} once the units stop; window needs {vram['window_needs']}\n")
    for cache in (plan.get("settings") or {}).get("caches", []):
        kept = "kept" if cache["kept"] else "not kept: compiled again at every boot"
        where = f" on {cache['mount']['target']}" if cache["kept"] and cache.get("mount") else ""
        via = f" (inside {cache['inside']})" if cache.get("inside") else ""
        out.write(f"compile cache: {cache['variable']} {cache['path'] or '(the user home is not known)'} "
                  f"{kept}{where}{via}\n")
    for warning in plan.get("warnings") or []:
        out.write(f"warning:       {warning}\n")
    model = plan.get("resident_files")
    if model is not None:
        rows = model.get("files") or []
        if not rows:
            out.write("resident files: none found (name them in [resident] files)\n")
        for f in rows:
            held = "cannot be read: " + f["error"] if f.get("error") else f"{f['cached'] * 100:.0f}% in RAM"
            out.write(f"resident file: {f['path']} ({f['size']}), {held}\n")
        if rows and not model.get("prefetch"):
            out.write("               not read back at close ([resident] prefetch = false)\n")
    warm = plan.get("resident_cache")
    if warm is not None:
        if not warm.get("kept"):
            out.write(f"resident cache: not kept ({warm.get('why')}): the resident comes back cold\n")
        else:
            held = (f"{warm['slots']} slots, {warm['tokens']} tokens" if "slots" in warm else
                    f"its slots cannot be read now: {warm.get('slots_error')}")
            size = f", about {warm['bytes'] / 2**20:.0f} MiB" if warm.get("bytes") is not None else ""
            out.write(f"resident cache: kept in {warm['dir']} ({held}{size}); costs {warm['cost']}\n")
    for problem in plan["problems"]:
        out.write(f"problem:       {problem}\n")
    out.write("ok: a window can open now\n" if plan["ok"] else "not ok: a window would fail now\n")


_SCHEMA = ("event", "window", "phase", "stage", "elapsed_s", "level", "ts")


def event_line(event: dict[str, Any]) -> str:
    """Say one event of ``gpuswapctl watch`` in a line: time, name, window, phase, then its own keys."""
    at = time.strftime("%H:%M:%S", time.localtime(event.get("ts") or time.time()))
    if event.get("event") == "subscribed":
        return f"{at} watching gpuswapd's events (Ctrl-C to stop)"
    where = ""
    if event.get("window"):
        where = f" {event['window']} {event.get('phase') or ''}"
        if event.get("stage"):
            where += f"/{event['stage']}"
        if event.get("elapsed_s") is not None:
            where += f" +{float(event['elapsed_s']):.1f}s"
    rest = " ".join(f"{k}={_value(v)}" for k, v in event.items() if k not in _SCHEMA)
    level = "" if event.get("level") in (None, "info") else f" [{event['level']}]"
    return f"{at} {event.get('event', '?'):<22}{level}{where}" + (f"  {rest}" if rest else "")


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return json.dumps(text) if (" " in text or not text) and isinstance(value, str) else text
