"""The resident's model files read into the page cache during a close, on in-process fakes."""

from __future__ import annotations

import asyncio
import io
import re
import threading
import time
from typing import Any

import pytest
import structlog

from gpuswapd.adapters.pagecache import FileCache
from gpuswapd.config import parse_config
from gpuswapd.ctl.render import print_plan
from gpuswapd.errors import ConfigError
from gpuswapd.observe.metrics import Metrics, window_now
from gpuswapd.outside import Outside
from gpuswapd.record import ContainerHandle, WindowRecord
from gpuswapd.window import Window
from gpuswapd.window.plan import make_plan
from gpuswapd.window.prefetch import parked_in_host_ram, unreadable
from tests.fakes import (
    CONFIG,
    DEADLINES,
    MODEL_BYTES,
    MODEL_PATH,
    PARK_CONFIG,
    PROFILES,
    RESIDENT_URL,
    SLOT_DIR,
    FakeWorld,
    GiB,
    running,
    settle,
)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def world(resident: str = "", extra: str = "") -> FakeWorld:
    text = CONFIG.replace("[resident]\n", f"[resident]\n{resident}", 1) + extra
    return FakeWorld(config=parse_config(text, "<prefetch>"))


class PrefetchGate:
    """The resident's start gate: it "loads" once the close's prefetch has got as far as a test needs.

    By default, once the prefetch has decided what to do (read, or why not); with ``ended``, once
    it has read and measured again. Without it, the fakes' close ends before the prefetch has got
    anywhere on a loaded machine, and ends the prefetch with it.
    """

    def __init__(self, ended: bool = False) -> None:
        self.window: Window | None = None
        self.pending = {None, "finding", "reading"} if ended else {None, "finding"}

    def wait(self, timeout: float) -> bool:
        """Wait (in the systemd worker's thread) until the window's prefetch is that far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            w = self.window
            if w is not None and not w.config.resident.prefetch:
                return True
            rec = w.record if w is not None else None
            if rec is not None and (rec.prefetch or {}).get("outcome") not in self.pending:
                return True
            time.sleep(0.002)
        return False


def gated(fw: FakeWorld, w: Window, ended: bool = False) -> None:
    """Hold the resident's start in ``w``'s closes until its prefetch is that far (``PrefetchGate``)."""
    gate = PrefetchGate(ended)
    gate.window = w
    fw.systemd.start_gate = gate  # type: ignore[assignment]


async def cycle(fw: FakeWorld, ended: bool = False, park_after: bool = False) -> dict[str, Any]:
    """Open a window, close it, and return its history record.

    ``park_after``: the engine is put to sleep only once the prefetch has decided.
    """
    outside = Outside(DEADLINES)
    async with running(fw.window(outside)) as w:
        gated(fw, w, ended)
        if park_after:
            async def inject(system: str, call: str, asynchronous: bool) -> None:
                deadline = time.monotonic() + 5
                while ((system, call) == ("http", "sleep") and w.record is not None and time.monotonic() < deadline
                       and (w.record.prefetch or {}).get("outcome") in (None, "finding")):
                    await asyncio.sleep(0.002)
            outside.inject(inject)
        lease = await w.acquire("job", 60)
        await w.release(lease.id)
        await settle(w)
    return fw.store.history_records[-1]


def test_a_close_reads_the_files_in_before_the_resident_starts_and_history_says_so() -> None:
    fw = FakeWorld()
    fw.files.read_s = 0.0
    record = run(cycle(fw, ended=True))  # the resident "loads" once the files are in
    p = record["prefetch"]
    assert p["outcome"] == "done", p
    assert p["cached_before"] == 0.0 and p["cached_after"] == 1.0 and p["bytes"] == MODEL_BYTES
    assert p["files"] == [{"path": MODEL_PATH, "bytes": MODEL_BYTES, "cached_before": 0.0, "cached_after": 1.0}]
    assert p["read_bytes"] == MODEL_BYTES and p["took_s"] >= 0
    assert isinstance(record["resident_s"], float) and record["resident_s"] >= 0
    assert fw.files.cached[MODEL_PATH] == MODEL_BYTES


def test_the_close_does_not_wait_for_the_prefetch_and_stops_it() -> None:
    fw = FakeWorld()  # a prefetch reads for 30 s unless stopped
    started = time.monotonic()
    record = run(cycle(fw))
    assert time.monotonic() - started < 5
    assert record["prefetch"]["outcome"] == "cancelled" and record["prefetch"]["cached_before"] == 0.0
    assert fw.files.stopped.wait(2), "the prefetch's worker was never told to stop"
    assert fw.files.prefetches == 1


def test_files_in_ram_already_are_not_read_again() -> None:
    fw = FakeWorld()
    fw.files.cached[MODEL_PATH] = MODEL_BYTES
    record = run(cycle(fw))
    assert record["prefetch"]["outcome"] == "cached" and record["prefetch"]["cached_after"] == 1.0
    assert fw.files.prefetches == 0


def test_no_prefetch_when_host_ram_cannot_hold_the_files() -> None:
    fw = FakeWorld()
    fw.files.mem_available = 10 * GiB
    with structlog.testing.capture_logs() as logs:
        record = run(cycle(fw))
    assert record["prefetch"]["outcome"] == "skipped" and fw.files.prefetches == 0
    assert "do not fit in the host's available memory: 10.0 GiB available" in record["prefetch"]["reason"]
    assert [e["event"] for e in logs].count("resident_prefetch_skipped") == 1


def test_a_level_one_park_keeps_its_weights_in_host_ram_and_leaves_less_for_the_files() -> None:
    fw = FakeWorld(config=PARK_CONFIG)  # level 1, no host_ram_needs: the window's 21 GiB are counted
    fw.files.mem_available = 40 * GiB
    # Measured before the engine sleeps (the fake's MemAvailable does not fall when it does).
    record = run(cycle(fw, park_after=True))
    assert record["prefetch"]["outcome"] == "skipped", record["prefetch"]
    assert "21.0 GiB of it for the engine's level-1 sleep" in record["prefetch"]["reason"]
    stop = FakeWorld()  # the same host without a park: the files fit
    stop.files.mem_available = 40 * GiB
    assert run(cycle(stop))["prefetch"]["outcome"] == "cancelled"


def test_what_a_park_keeps_in_host_ram() -> None:
    w = FakeWorld(config=parse_config(CONFIG + '[window.park]\nmode = "sleep"\nhost_ram_needs = "30GiB"\n')).window()
    rec = WindowRecord.new()
    rec.container = ContainerHandle(name="hyperqwen", sleep=True)
    assert parked_in_host_ram(w, rec, 64 * GiB) == 30 * GiB
    assert parked_in_host_ram(w, rec, 20 * GiB) == 0  # parking lowers itself to level 2 then
    rec.container = ContainerHandle(name="hyperqwen", sleep=False)  # it cannot sleep: removed, nothing kept
    assert parked_in_host_ram(w, rec, 64 * GiB) == 0
    assert parked_in_host_ram(FakeWorld().window(), WindowRecord.new(), 64 * GiB) == 0  # park.mode = "stop"


def test_a_direct_switch_reads_nothing_into_ram() -> None:
    fw = FakeWorld(config=parse_config(CONFIG + PROFILES))

    async def main() -> None:
        async with running(fw.window()) as w:
            first = await w.acquire("chat", 60)
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            while not w.queue.queued():
                await asyncio.sleep(0.002)
            await w.release(first.id)
            second = await waiting
            await w.release(second.id)
            await settle(w)

    run(main())
    switched, back = fw.store.history_records
    assert switched["switched_to"] and switched["prefetch"] is None
    assert back["prefetch"] is not None  # the window that gives the card back restores the resident


def test_prefetch_off_reads_nothing_and_named_files_win_over_the_units() -> None:
    off = world('prefetch = false\n')
    assert run(cycle(off))["prefetch"] is None and off.files.prefetches == 0
    # The slot save path named too: the cache's own read of the units (warm.py) is not the prefetch's.
    named = world(f'files = ["{MODEL_PATH}", "/models/missing.gguf"]\n',
                  f'[resident.cache]\nsave_path = "{SLOT_DIR}"\n')
    named.files.read_s = 0.0
    with structlog.testing.capture_logs() as logs:
        record = run(cycle(named, ended=True))
    assert named.systemd.commands_read == 0
    assert record["prefetch"]["outcome"] == "done" and [f["path"] for f in record["prefetch"]["files"]] == [MODEL_PATH]
    skipped = [e for e in logs if e["event"] == "resident_file_skipped"]
    assert len(skipped) == 1 and "/models/missing.gguf: no such file" in skipped[0]["reason"]


def test_what_cannot_be_found_is_logged_once_not_at_every_close() -> None:
    fw = FakeWorld()
    fw.systemd.exec_start["strata.service"] = ("/usr/bin/llama-server", "-hf", "org/strata-GGUF")

    async def main() -> None:
        async with running(fw.window()) as w:
            gated(fw, w)
            for _ in range(2):
                await w.release((await w.acquire("job", 60)).id)
                await settle(w)

    with structlog.testing.capture_logs() as logs:
        run(main())
    skipped = [e["reason"] for e in logs if e["event"] == "resident_file_skipped"]
    assert skipped == ["strata.service: -hf 'org/strata-GGUF': llama.cpp downloads that model into its own cache",
                       "no model file found in what strata.service, llama-swap.service run"]
    assert [h["prefetch"]["outcome"] for h in fw.store.history_records] == ["no_files", "no_files"]


def test_plan_lists_each_file_with_its_size_and_cached_fraction_and_the_metric_follows() -> None:
    fw = FakeWorld()
    fw.files.cached[MODEL_PATH] = MODEL_BYTES // 4

    async def main() -> dict[str, Any]:
        w = fw.window()
        metrics = Metrics(lambda: window_now(w), "test")
        assert b"gpuswapd_resident_cached_ratio{" not in metrics.exposition()  # not measured yet
        plan = await make_plan(fw.config, w.resident, w.engine, w.vram, files=w.files)
        assert b'gpuswapd_resident_cached_ratio{instance="default"} 0.25' in metrics.exposition()
        w.outside.close()
        return plan.to_dict()

    plan = run(main())
    assert plan["resident_files"] == {
        "files": [{"path": MODEL_PATH, "bytes": MODEL_BYTES, "size": "20.1 GiB", "cached": 0.25, "error": None}],
        "cached": 0.25, "prefetch": True}


def test_an_unreadable_file_says_what_to_do() -> None:
    f = FileCache("/srv/m.gguf", "/srv/m.gguf", 10, error="permission denied", denied=True, mode="0640",
                  owner="alice", group="models")
    assert "SupplementaryGroups=models" in unreadable(f) and "chmod o+r" in unreadable(f)
    assert "mode 0640, owner alice, group models" in unreadable(f)
    hidden = FileCache("/srv/m.gguf", "/srv/m.gguf", error="permission denied", denied=True)
    assert "a directory on its path is not searchable" in unreadable(hidden)
    assert "PrivateTmp=yes" in unreadable(FileCache("/tmp/m.gguf", "/tmp/m.gguf", error="no such file"))


def test_the_plan_prints_each_file_and_what_of_it_is_in_ram() -> None:
    plan = {"units": ["strata.service"], "timers": [], "jobs_running": [], "resident_busy": None,
            "container": None, "problems": [], "ok": True, "resident_files": {
                "files": [{"path": MODEL_PATH, "bytes": MODEL_BYTES, "size": "20.1 GiB", "cached": 0.25, "error": None},
                          {"path": "/srv/x.gguf", "bytes": 0, "size": "0 B", "cached": None,
                           "error": "/srv/x.gguf: no such file"}], "cached": 0.25, "prefetch": False}}
    out = io.StringIO()
    print_plan(plan, out)
    assert f"resident file: {MODEL_PATH} (20.1 GiB), 25% in RAM" in out.getvalue()
    assert "resident file: /srv/x.gguf (0 B), cannot be read: /srv/x.gguf: no such file" in out.getvalue()
    assert "not read back at close ([resident] prefetch = false)" in out.getvalue()


@pytest.mark.parametrize(("patch", "says"), [
    ('files = "/m.gguf"\n', "resident.files: expected a list of strings"),
    ('files = ["m.gguf"]\n', "resident.files[0]: must be an absolute path, got 'm.gguf'"),
    ('prefetch = "yes"\n', "resident.prefetch: expected true or false"),
])
def test_bad_resident_files_keys_name_the_key(patch: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        world(patch)


def test_a_hung_read_of_the_units_never_holds_up_the_close() -> None:
    fw = world("", f'[resident.cache]\nsave_path = "{SLOT_DIR}"\n')  # only the prefetch reads the units
    answer = threading.Event()
    commands = fw.systemd.commands

    def hangs(unit: str) -> Any:
        answer.wait(10)  # until the test lets it go: long after the lane's deadline
        return commands(unit)

    fw.systemd.commands = hangs  # type: ignore[method-assign]
    seen_hung: list[bool] = []

    async def main() -> None:
        async with running(fw.window()) as w:
            verify = fw.http.verify

            async def late_verify(check: Any, retry_until: float | None = None, *more: Any) -> Any:
                if check.url != RESIDENT_URL:  # the engine's
                    return await verify(check, retry_until, *more)
                # The resident answers only once the read has outlived its deadline (a slow load).
                deadline = time.monotonic() + w.outside.systemd.deadline + 5
                while not w.outside.status()["systemd"]["hung"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                seen_hung.append(bool(w.outside.status()["systemd"]["hung"]))
                return await verify(check, retry_until, *more)

            fw.http.verify = late_verify  # type: ignore[method-assign]
            await w.release((await w.acquire("job", 60)).id)
            await settle(w, timeout=5)  # the close would wait here for the hung call if it counted
            assert w.outside.status()["systemd"]["hung"][0]["call"] == "commands"
            answer.set()

    try:
        run(main())
    finally:
        answer.set()
    [record] = fw.store.history_records
    assert seen_hung == [True]
    assert record["outcome"] == "closed" and record["prefetch"]["outcome"] == "failed"
    assert "did not answer (commands)" in record["prefetch"]["error"]


def test_a_name_where_a_path_would_be_is_no_file_of_the_resident() -> None:
    fw = FakeWorld()
    fw.systemd.exec_start["llama-swap.service"] = ("/usr/bin/llama-swap", "--listen", ":8080", "--model", "strata")

    async def main() -> list[dict[str, Any]]:
        w = fw.window()
        first = await make_plan(fw.config, w.resident, w.engine, w.vram, files=w.files)
        again = await make_plan(fw.config, w.resident, w.engine, w.vram, files=w.files)
        w.outside.close()
        return [first.to_dict(), again.to_dict()]

    with structlog.testing.capture_logs() as logs:
        plans = run(main())
    for plan in plans:
        assert [f["path"] for f in plan["resident_files"]["files"]] == [MODEL_PATH]
    skipped = [e["reason"] for e in logs if e["event"] == "resident_file_skipped"]
    assert skipped == ["/strata: no such file, so not a model file of the resident (a name, or a path only the "
                       "unit sees)"]
