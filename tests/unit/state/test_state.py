"""The state document on a real directory: torn, corrupt, foreign and missing copies, full disks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from gpuswapd.phases import Phase
from gpuswapd.record import WindowRecord
from gpuswapd.state.store import Document, StateStore, decode, encode


def _record(phase: Phase = Phase.READY) -> WindowRecord:
    rec = WindowRecord.new(1000.0)
    for p in (Phase.DRAINING, Phase.PAUSING_TIMERS, Phase.STOPPING_RESIDENT, Phase.WAITING_VRAM, Phase.BOOTING,
              Phase.WARMING, Phase.READY):
        rec.enter(p, 1000.0)
        if p is phase:
            break
    rec.timers, rec.units = ["agent-a.timer"], ["strata.service", "llama-swap.service"]
    rec.leases.grant("job", 60, 1000.0, "job.service", 0)
    return rec


def _store(tmp_path: Path) -> StateStore:
    store = StateStore(tmp_path / "state")
    store.prepare()
    return store


def _write(store: StateStore, seq: int, rec: WindowRecord | None) -> None:
    store.write(encode(Document(seq=seq, window=rec)))


def test_a_document_round_trips_with_its_checksum(tmp_path: Path) -> None:
    store = _store(tmp_path)
    rec = _record()
    _write(store, 1, rec)
    loaded = store.load()
    assert loaded.problems == [] and loaded.document is not None
    assert loaded.document.seq == 1
    assert loaded.document.window is not None and loaded.document.window.to_dict() == rec.to_dict()
    body = json.loads(store.current.read_text())
    assert body["version"] == 2 and body["parked"] is None and body["queue"] == [] and len(body["sha256"]) == 64


def test_a_torn_document_falls_back_to_the_previous_copy(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1, _record(Phase.PAUSING_TIMERS))
    _write(store, 2, _record(Phase.READY))
    data = store.current.read_bytes()
    store.current.write_bytes(data[: len(data) // 2])  # torn
    loaded = store.load()
    assert loaded.document is not None and loaded.document.seq == 1
    assert loaded.document.window is not None and loaded.document.window.phase is Phase.PAUSING_TIMERS
    assert loaded.problems and "state.json" in loaded.problems[0] and "torn" in loaded.problems[0]
    assert not loaded.unreadable


@pytest.mark.parametrize(("damage", "why"), [
    (lambda b: b.replace(b'"job.service"', b'"jab.service"'), "checksum mismatch"),
    (lambda b: b.replace(b'"version":2', b'"version":3'), "version 3"),
    (lambda b: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (lambda b: b"\xff\xfe garbage", "not JSON"),
    (lambda b: b"", "not JSON"),
])
def test_a_damaged_document_is_skipped_with_a_reason(tmp_path: Path, damage, why: str) -> None:
    store = _store(tmp_path)
    _write(store, 1, _record())
    _write(store, 2, _record())
    store.current.write_bytes(damage(store.current.read_bytes()))
    loaded = store.load()
    assert loaded.document is not None and loaded.document.seq == 1
    assert why in loaded.problems[0]


def test_a_phase_from_another_version_is_skipped(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1, _record())
    _write(store, 2, _record())
    body = json.loads(encode(Document(seq=3, window=_record())))
    body["window"]["phase"] = "HIBERNATING"
    del body["sha256"]  # a valid checksum over the foreign body: only the phase is wrong
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["sha256"] = hashlib.sha256(canonical).hexdigest()
    store.current.write_text(json.dumps(body))
    loaded = store.load()
    assert loaded.document is not None and loaded.document.seq == 1
    assert "unknown phase 'HIBERNATING'" in loaded.problems[0]


def test_nothing_readable_is_unreadable_and_nothing_written_is_fresh(tmp_path: Path) -> None:
    store = _store(tmp_path)
    fresh = store.load()
    assert fresh.document is None and not fresh.unreadable
    _write(store, 1, _record())
    _write(store, 2, _record())
    store.current.write_bytes(b"{")
    store.previous.write_bytes(b"")
    lost = store.load()
    assert lost.document is None and lost.unreadable and len(lost.problems) == 2
    assert sorted(store.set_aside()) == ["state.json.unreadable", "state.prev.json.unreadable"]
    assert store.load().unreadable  # the originals stay until a good document replaces them


def test_an_unreadable_directory_entry_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.current.mkdir()  # EISDIR on read
    loaded = store.load()
    assert loaded.unreadable and "state.json" in loaded.problems[0]


def test_the_format_of_gpuswapd_0_1_is_migrated(tmp_path: Path) -> None:
    store = _store(tmp_path)
    rec = _record(Phase.STOPPING_RESIDENT)
    legacy = rec.to_dict()
    for t in legacy["timings"]:
        del t["stage"]
    store.legacy.write_text(json.dumps(legacy))
    loaded = store.load()
    assert loaded.migrated and loaded.document is not None and loaded.document.window is not None
    assert loaded.document.window.units == rec.units
    assert all(t.stage == "open" for t in loaded.document.window.timings)
    assert not store.legacy.exists() and (store.dir / "current.json.migrated").exists()
    assert decode(store.current.read_bytes()).window is not None


def test_a_torn_legacy_file_is_unreadable(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.legacy.write_text('{"id": "x", "phase": "REA')
    assert store.load().unreadable


def test_short_writes_still_write_the_whole_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:7])))
    _write(store, 1, _record())
    monkeypatch.undo()
    assert store.load().document is not None


def test_a_full_disk_keeps_the_last_good_document_and_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    _write(store, 1, _record())

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        _write(store, 2, _record())
    monkeypatch.undo()
    loaded = store.load()
    assert loaded.document is not None and loaded.document.seq == 1 and loaded.problems == []
    assert sorted(p.name for p in store.dir.iterdir()) == ["state.json"]


def test_writers_never_share_a_temporary_file(tmp_path: Path) -> None:
    store = _store(tmp_path)
    errors: list[BaseException] = []

    def write(seq: int) -> None:
        try:
            for n in range(20):
                _write(store, seq * 100 + n, _record())
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    loaded = store.load()
    assert loaded.problems == [] and loaded.document is not None
    assert not [p for p in store.dir.iterdir() if p.name.endswith(".tmp")]


def test_history_keeps_the_newest_windows_and_skips_junk(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.append_history([{"id": str(n)} for n in range(205)])
    with store.history_file.open("a") as f:
        f.write("not json\n" + "[" * 100_000 + "\n")
    history = store.history(1000)
    assert len(history) == 200 and history[-1] == {"id": "204"} and history[0] == {"id": "5"}
