"""The page cache adapter on real files: mincore's count, reading in what is missing, stopping, what it cannot read."""

from __future__ import annotations

import errno
import os
import pwd
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuswapd.adapters import pagecache
from gpuswapd.adapters.pagecache import Identity, PageCache, Progress, evict, measure_file

CHUNK = 1 << 20  # the prefetch's chunk, smaller here: a small file has as many chunks
SIZE = 8 * CHUNK + 12345  # not a whole number of pages or chunks


@pytest.fixture(scope="module")
def model() -> Iterator[Path]:
    """A file on a disk (not tmpfs, where the page cache is the file), written and synced once."""
    chunk, pagecache.CHUNK = pagecache.CHUNK, CHUNK
    try:
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="gpuswapd-pagecache-") as d:
            path = Path(d) / "model.gguf"
            with open(path, "wb") as f:
                f.write(b"\x5a" * SIZE)
                f.flush()
                os.fsync(f.fileno())  # only clean pages can be dropped
            yield path
    finally:
        pagecache.CHUNK = chunk


def test_a_file_dropped_from_the_page_cache_measures_empty_and_a_prefetch_reads_all_of_it(model: Path) -> None:
    evict(str(model))
    before = measure_file(str(model))
    assert before.size == SIZE and before.error is None and before.ratio < 0.05
    progress = Progress(cached=before.cached, measured=measured(model))
    PageCache().prefetch([str(model)], threading.Event(), progress)
    after = measure_file(str(model))
    assert after.ratio == 1.0 and after.cached == SIZE
    assert progress.cached == SIZE and SIZE - before.cached - pagecache.PAGE <= progress.read <= SIZE


def test_what_is_cached_already_is_not_read_again(model: Path) -> None:
    PageCache().prefetch([str(model)], threading.Event(), Progress(measured=measured(model)))
    progress = Progress(measured=measured(model))
    PageCache().prefetch([str(model)], threading.Event(), progress)
    assert progress.read == 0 and progress.skipped == []


def measured(*paths: Path) -> dict[str, Identity]:
    """Measure the files as the window does before it reads them: what the prefetch may read."""
    out = {}
    for path in paths:
        identity = measure_file(str(path)).identity
        assert identity is not None
        out[str(path)] = identity
    return out


class StopAfter(threading.Event):
    """A stop that is set once it has been looked at ``n`` times (after so many chunks)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0 or super().is_set()


def test_a_stopped_prefetch_ends_within_a_chunk(model: Path) -> None:
    evict(str(model))
    progress = Progress(measured=measured(model))
    PageCache().prefetch([str(model)], StopAfter(3), progress)  # the file's check, then two chunks
    assert 0 < progress.read <= 3 * CHUNK
    assert measure_file(str(model)).ratio < 0.6
    stopped = threading.Event()
    stopped.set()
    evict(str(model))
    progress = Progress(measured=measured(model))
    PageCache().prefetch([str(model)], stopped, progress)
    assert progress.read == 0


def test_two_names_of_one_file_count_once_and_memavailable_is_read(model: Path, tmp_path: Path) -> None:
    link = tmp_path / "strata.gguf"
    link.symlink_to(model)
    measured = PageCache().measure([str(link), str(model)])
    assert [f.path for f in measured.files] == [str(link)] and measured.files[0].real == str(model)
    assert measured.mem_available is not None and measured.mem_available > 0


def test_what_cannot_be_measured_says_why(tmp_path: Path) -> None:
    missing = measure_file(str(tmp_path / "nope.gguf"))
    assert missing.error == "no such file" and not missing.denied and missing.size == 0
    assert measure_file(str(tmp_path)).error == "not a regular file"
    empty = tmp_path / "empty.gguf"
    empty.touch()
    assert measure_file(str(empty)).ratio == 1.0


def test_a_file_gpuswapd_may_not_read_is_denied_with_its_mode_and_owner(model: Path) -> None:
    secret = model.parent / "secret.gguf"
    secret.write_bytes(b"x" * 4096)
    secret.chmod(0o600)
    if os.geteuid() != 0:
        secret.chmod(0o000)
        found = measure_file(str(secret))
    else:  # root reads anything: measure as nobody, in a child
        model.parent.chmod(0o755)
        found = _as_nobody(str(secret))
    assert found.denied and found.error == "permission denied" and found.size == 4096
    assert found.mode in ("0600", "0000") and found.owner


def test_a_mincore_a_system_call_filter_refuses_is_named_not_taken_for_the_files_mode(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(fd: int, offset: int, span: int, pages: int) -> int:
        raise OSError(errno.EPERM, "mincore: Operation not permitted")  # as _os_error("mincore") makes it

    monkeypatch.setattr(pagecache, "_resident_pages", refused)
    found = measure_file(str(model))
    assert found.error == "mincore: Operation not permitted" and not found.denied and found.size == SIZE


def test_a_directory_on_the_way_that_may_not_be_searched_is_denied_too(model: Path) -> None:
    closed = model.parent / "closed"
    closed.mkdir(mode=0o700, exist_ok=True)
    (closed / "m.gguf").write_bytes(b"x")
    if os.geteuid() != 0:
        closed.chmod(0o000)
        found = measure_file(str(closed / "m.gguf"))
        closed.chmod(0o700)
    else:
        model.parent.chmod(0o755)
        found = _as_nobody(str(closed / "m.gguf"))
    assert found.denied and found.error == "permission denied" and found.mode == ""


def _as_nobody(path: str) -> pagecache.FileCache:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            nobody = pwd.getpwnam("nobody")
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            f = measure_file(path)
            os.write(write_end, repr((f.error, f.denied, f.size, f.mode, f.owner)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as r:
        error, denied, size, mode, owner = eval(r.read())
    os.waitpid(pid, 0)
    return pagecache.FileCache(path, path, size, error=error, denied=denied, mode=mode, owner=owner)


# -- whatever the path names at read time ------------------------------------------------------


def test_a_fifo_is_measured_at_once_as_no_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    got: list[pagecache.FileCache] = []
    worker = threading.Thread(target=lambda: got.append(measure_file(str(fifo))), daemon=True)
    worker.start()
    worker.join(5)  # open(2) without O_NONBLOCK waits for a writer for ever
    if worker.is_alive():
        with open(fifo, "wb"):  # let it go
            pass
        pytest.fail("the measure blocked in open(2) on a FIFO")
    assert got[0].error == "not a regular file" and got[0].identity is None


def _disk_file(directory: Path, name: str, size: int) -> Path:
    path = directory / name
    path.write_bytes(b"\x5a" * size)
    return path


def test_a_fifo_swapped_in_after_the_measure_is_skipped_without_blocking(model: Path) -> None:
    path = _disk_file(model.parent, "fifo-swap.gguf", 3 * CHUNK)
    allowed = measured(path)
    path.unlink()
    os.mkfifo(path)
    try:
        progress = Progress(measured=allowed)
        worker = threading.Thread(target=PageCache().prefetch, args=([str(path)], threading.Event(), progress))
        worker.start()
        worker.join(5)
        if worker.is_alive():
            with open(path, "wb"):  # let it go
                pass
            pytest.fail("the prefetch blocked in open(2) on a FIFO")
        assert progress.read == 0 and len(progress.skipped) == 1 and "not a regular file" in progress.skipped[0]
    finally:
        path.unlink()


def test_a_larger_sparse_file_swapped_in_is_not_read(model: Path) -> None:
    path = _disk_file(model.parent, "sparse-swap.gguf", CHUNK)
    allowed = measured(path)
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(96 * CHUNK)  # sparse: reading it costs nothing on disk but fills the page cache
    try:
        progress = Progress(measured=allowed)
        PageCache().prefetch([str(path)], threading.Event(), progress)
        assert progress.read == 0 and len(progress.skipped) == 1
        assert "not the file measured" in progress.skipped[0] and str(96 * CHUNK) in progress.skipped[0]
    finally:
        path.unlink()


def test_a_file_grown_in_place_since_its_measure_is_not_read(model: Path) -> None:
    path = _disk_file(model.parent, "grown.gguf", CHUNK)
    allowed = measured(path)
    with open(path, "r+b") as f:
        f.truncate(8 * CHUNK)  # the same inode, larger
    try:
        progress = Progress(measured=allowed)
        PageCache().prefetch([str(path)], threading.Event(), progress)
        assert progress.read == 0 and "not the file measured" in progress.skipped[0]
        unmeasured = Progress()
        PageCache().prefetch([str(path)], threading.Event(), unmeasured)
        assert unmeasured.read == 0 and unmeasured.skipped == [f"{path}: not measured"]
    finally:
        path.unlink()


def test_one_symlink_is_followed_as_in_a_hugging_face_cache_and_a_link_to_a_link_is_not(
        model: Path, tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    blob.write_bytes(b"x" * 8192)
    snapshot = tmp_path / "snapshots" / "main" / "model.gguf"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to("../../blobs/0123abcd")  # relative, as huggingface_hub makes them
    found = measure_file(str(snapshot))
    assert found.error is None and found.size == 8192 and found.identity is not None
    assert found.identity.inode == os.stat(blob).st_ino
    progress = Progress(measured={str(snapshot): found.identity})
    PageCache().prefetch([str(snapshot)], threading.Event(), progress)
    assert progress.skipped == []
    twice = tmp_path / "twice.gguf"
    twice.symlink_to(snapshot)
    assert measure_file(str(twice)).error is not None
