"""The resident's slots saved before the window and restored after its verify, on in-process fakes."""

from __future__ import annotations

import asyncio
import io
from typing import Any

from gpuswapd.adapters.unitstates import Commands
from gpuswapd.config import parse_config
from gpuswapd.ctl.render import print_plan
from gpuswapd.observe.metrics import Metrics, window_now
from gpuswapd.outside import Outside
from gpuswapd.parts.modelfiles import slot_save_path
from gpuswapd.window.plan import make_plan
from gpuswapd.window.warm import prefix
from tests.fakes import CONFIG, DEADLINES, KV_PER_TOKEN, SLOT_DIR, FakeWorld, running, settle


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def world(extra: str = "") -> FakeWorld:
    return FakeWorld(config=parse_config(CONFIG + extra, "<warm>"))


async def cycle(fw: FakeWorld, at_ready: Any = None) -> dict[str, Any]:
    """Open a window, (do ``at_ready``), close it; return its history record."""
    async with running(fw.window(Outside(DEADLINES))) as w:
        lease = await w.acquire("job", 60)
        if at_ready is not None:
            at_ready(fw)
        await w.release(lease.id)
        await settle(w)
    return fw.store.history_records[-1]


def test_a_window_saves_the_slot_with_a_context_and_restores_it_after_the_verify() -> None:
    fw = FakeWorld()
    seen: dict[str, Any] = {}
    record = run(cycle(fw, lambda fw: seen.update(files=dict(fw.http.slot_files.files),
                                                    strata=fw.systemd.units["strata.service"].active_state)))
    cache = record["cache"]
    # Saved before the stop: slot 0 held the agent's context; slot 1 was empty and is not saved.
    assert cache["outcome"] == "saved" and cache["dir"] == SLOT_DIR and cache["tokens"] == 1566
    assert [f["slot"] for f in cache["files"]] == [0] and cache["bytes"] == 1566 * KV_PER_TOKEN + 100
    assert list(seen["files"]) == [cache["files"][0]["file"]] and seen["strata"] == "inactive"
    # Restored after the verify, which answered in slot 1 (no file fills it), before the timers resumed.
    assert fw.http.verify_slots == [1]
    restore = cache["restore"]
    assert restore["outcome"] == "restored" and restore["tokens"] == 1566 and restore["slots"][0]["slot"] == 0
    assert fw.http.slot_tokens == {0: 1566, 1: 20}
    assert record["outcome"] == "closed" and record["degraded"] is None and record["restored"] == "as_it_was"
    # No file outlives its window.
    assert fw.http.slot_files.files == {} and cache["removed"] is True


def test_a_changed_model_between_save_and_restore_skips_the_restore() -> None:
    fw = FakeWorld()

    def replace_model(fw: FakeWorld) -> None:
        fw.http.slot_files.model_mtime = 2  # the operator put another GGUF at the same path

    record = run(cycle(fw, replace_model))
    restore = record["cache"]["restore"]
    assert restore["outcome"] == "mismatch" and "it is /models/strata.gguf" in restore["reason"]
    assert restore["tokens"] == 0 and fw.http.slot_tokens[0] == 0  # nothing went into the slot
    assert record["outcome"] == "closed" and record["degraded"] is None
    assert fw.http.slot_files.files == {}


def test_a_changed_context_between_save_and_restore_skips_the_restore() -> None:
    fw = FakeWorld()

    def smaller_context(fw: FakeWorld) -> None:
        fw.systemd.units["strata.service"].n_ctx = 2048

    record = run(cycle(fw, smaller_context))
    assert record["cache"]["restore"]["outcome"] == "mismatch" and "ctx=2048" in record["cache"]["restore"]["reason"]
    assert fw.http.slot_files.files == {}


def test_a_save_past_its_deadline_is_skipped_and_the_window_opens() -> None:
    fw = world('[resident.cache]\nsave_timeout = "100ms"\n')
    fw.http.save_s = 5.0
    record = run(cycle(fw))
    cache = record["cache"]
    assert cache["outcome"] == "timeout" and "save_timeout = 0.1s" in cache["reason"] and cache["save_s"] < 1
    assert "READY" in [t["phase"] for t in record["timings"]] and record["outcome"] == "closed"
    assert "restore" not in cache and fw.http.verify_slots == [None]
    assert fw.http.slot_files.files == {}


def test_a_failed_restore_leaves_the_resident_serving_and_the_window_closed_normally() -> None:
    fw = FakeWorld()
    fw.http.fail_restore = True
    record = run(cycle(fw))
    restore = record["cache"]["restore"]
    assert restore["outcome"] == "failed" and "Unable to restore slot" in restore["reason"]
    assert record["outcome"] == "closed" and record["degraded"] is None and record["error"] is None
    assert "DEGRADED" not in [t["phase"] for t in record["timings"]]
    assert fw.snapshot()["units"] == {"strata.service": "active", "llama-swap.service": "active"}
    assert fw.http.slot_files.files == {}


def test_slots_beyond_the_size_limit_or_the_disk_are_not_saved() -> None:
    fw = world('[resident.cache]\nmax_size = "1KiB"\n')
    record = run(cycle(fw))
    cache = record["cache"]
    # The first save learns the size per token; a file over the limit is removed at once.
    assert cache["outcome"] == "skipped" and "max_size" in cache["reason"] and fw.http.slot_files.files == {}
    full = FakeWorld()
    full.http.slot_files.free_bytes = 1024**2  # less than the margin gpuswapd leaves free
    cache = run(cycle(full))["cache"]
    assert cache["outcome"] == "skipped" and "no room on the disk" in cache["reason"]
    assert full.http.slot_files.files == {}


def test_stale_files_of_an_earlier_window_are_removed_before_the_save() -> None:
    fw = FakeWorld()
    stale = "gpuswapd-0fca31-20200101-000000-aaaaaa-000000000000-slot0.bin"
    other = "someone-elses.bin"
    fw.http.slot_files.files.update({stale: (0, 10, 100), other: (0, 10, 100)})
    w = fw.window()
    assert stale.startswith(prefix(w))  # this gpuswapd's (its state directory's) own
    w.outside.close()
    run(cycle(fw))
    assert fw.http.slot_files.files == {other: (0, 10, 100)}  # never another program's


def test_off_or_no_save_path_keeps_nothing_and_asks_no_slot() -> None:
    off = world('[resident.cache]\nkeep = "off"\n')
    assert run(cycle(off))["cache"] is None and off.http.verify_slots == [None]
    bare = FakeWorld()
    bare.systemd.exec_start["strata.service"] = ("/usr/bin/llama-server", "-m", "/models/strata.gguf")
    assert run(cycle(bare))["cache"] is None and bare.http.slot_files.files == {}


def test_the_metric_counts_the_tokens_restored_and_plan_says_the_cache_is_kept() -> None:
    fw = FakeWorld()

    async def main() -> tuple[bytes, str]:
        async with running(fw.window(Outside(DEADLINES))) as w:
            metrics = Metrics(lambda: window_now(w), "test")
            w.finished.append(metrics.window_finished)
            plan = await make_plan(fw.config, w.resident, w.engine, w.vram, files=w.files)
            await w.release((await w.acquire("job", 60)).id)
            await settle(w)
            out = io.StringIO()
            print_plan(plan.to_dict(), out)
            return metrics.exposition(), out.getvalue()

    exposition, text = run(main())
    assert b'gpuswapd_resident_prefill_tokens_saved_total{instance="default"} 1566.0' in exposition
    assert f"resident cache: kept in {SLOT_DIR} (1 slots, 1566 tokens)" in text


def test_the_save_path_is_found_in_a_wrapper_or_a_shell_and_in_either_spelling() -> None:
    def found(*argv: str, env: tuple[str, ...] = ()) -> str | None:
        return slot_save_path(Commands("strata.service", (argv,), environment=env))

    assert found("/usr/bin/gpu-hold", "--", "/usr/bin/llama-server", "--slot-save-path", "/var/slots") == "/var/slots"
    assert found("/usr/bin/llama-server", "--slot-save-path=/var/slots/") == "/var/slots"
    assert found("/bin/sh", "-c", "exec llama-server -m m.gguf --slot-save-path $SLOTS",
                 env=("SLOTS=/srv/slots",)) == "/srv/slots"
    assert found("/usr/bin/llama-server", "-m", "/models/x.gguf") is None
    assert found("/usr/bin/llama-server", "--slot-save-path") is None
