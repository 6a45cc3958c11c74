"""The metrics textfile: replaced atomically with mode 0644 whatever the umask, at most once per interval."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpuswapd.observe.textfile import Textfile, temporary_name, write_atomically


def test_the_file_is_0644_under_umask_0077_and_the_temporary_name_is_not_read_by_node_exporter(
        tmp_path: Path) -> None:
    target = tmp_path / "gpuswapd.prom"
    old = os.umask(0o077)
    try:
        write_atomically(target, b"gpuswapd_leases 0\n")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"gpuswapd_leases 0\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    tmp = temporary_name(target)
    assert tmp.parent == target.parent and not tmp.name.endswith(".prom") and tmp.name.startswith(".")
    assert [p.name for p in tmp_path.iterdir()] == ["gpuswapd.prom"]  # nothing left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "gpuswapd.prom"
    write_atomically(target, b"old 1\n")
    (tmp_path / "sub.prom").mkdir()
    with contextlib.suppress(OSError):
        write_atomically(tmp_path / "sub.prom", b"x\n")  # rename over a directory fails
    assert target.read_bytes() == b"old 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpuswapd.prom", "sub.prom"]


def test_requests_are_coalesced_and_a_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "gpuswapd.prom"
    counter = 0
    failures: list[str] = []
    reads = 0
    stop = threading.Event()

    def render() -> bytes:
        # Big enough that a non-atomic write would be seen half done.
        return ("# TYPE gpuswapd_x gauge\n" + "".join(f'gpuswapd_x{{n="{i}"}} {counter}\n'
                                                       for i in range(1000))).encode()

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            try:
                text = target.read_text()
            except FileNotFoundError:
                continue
            try:
                [family] = list(text_string_to_metric_families(text))
                if len(family.samples) != 1000 or len({s.value for s in family.samples}) != 1:
                    failures.append(f"{len(family.samples)} samples")
            except Exception as err:
                failures.append(repr(err))
            reads += 1

    async def main() -> tuple[Textfile, float]:
        nonlocal counter
        started = time.monotonic()
        textfile = Textfile(target, render, min_interval=0.05)
        for _ in range(30):  # 30 requests over ~0.15 s: about 4 writes, not 30
            counter += 1
            textfile.request()
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        await textfile.close()
        return textfile, time.monotonic() - started

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        textfile, took = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        stop.set()
        thread.join()
    assert failures == [] and reads > 0
    # At most one write per interval (and the last one at close), however slow the machine made the loop.
    assert 2 <= textfile.writes <= took / 0.05 + 2 and textfile.writes < 30, (textfile.writes, took)
    assert f"}} {counter}" in target.read_text()  # the last state is written
