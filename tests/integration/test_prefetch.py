"""The resident's model files on the test world: plan lists them, a close reads back what a window pushed out.

strata.service runs llama-server behind a wrapper (``gpu_hold.py ... -- llama-server -m MODEL``):
gpuswapd finds MODEL in its ExecStart= over the world's D-Bus. The test drops the file from the
page cache while the window holds the card (posix_fadvise DONTNEED; the resident is down then, so
no process maps it), as an engine's weights would, and reads the page cache itself with mincore.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuswapd.adapters.pagecache import evict, measure_file
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import RESIDENT_UNITS, Probe
from tests.stack.world import REPO, Stack

pytestmark = pytest.mark.stack
Start = Callable[..., RunningDaemon]
NOBODY = pwd.getpwnam("nobody")


def test_plan_lists_the_files_and_a_close_reads_back_what_the_window_pushed_out(gpuswapd: Start, world: Stack,
                                                                                probe: Probe) -> None:
    daemon = gpuswapd()
    model = world.resident_model  # the path in strata's ExecStart= (a link to the cached GGUF)
    plan = daemon.ctl_json("plan")["plan"]["resident_files"]
    assert [f["path"] for f in plan["files"]] == [str(model)]
    [row] = plan["files"]
    assert row["bytes"] == model.stat().st_size and row["error"] is None
    assert row["cached"] == pytest.approx(measure_file(str(model)).ratio, abs=0.05)

    assert daemon.ctl("acquire", "--for", "2m").returncode == 0
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    evict(str(model))
    assert measure_file(str(model)).ratio < 0.05
    # It exits 1 while the window is open (its engine's container runs, the resident does not
    # answer): a window would fail now. What it measures of the files is there all the same.
    during = json.loads(daemon.ctl("plan", "--json").stdout)["plan"]
    assert during["resident_files"]["files"][0]["cached"] < 0.05

    assert daemon.ctl("release").returncode == 0
    last = daemon.wait_phase("IDLE")["last"]
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")
    [record] = daemon.ctl_json("history", "--limit", "1")["windows"]
    assert record["id"] == last["id"]
    p = record["prefetch"]
    assert p["outcome"] == "done", p
    assert p["cached_before"] < 0.05 and p["cached_after"] >= 0.9
    assert [f["path"] for f in p["files"]] == [str(model)] and p["read_bytes"] > 0.9 * model.stat().st_size
    restoring = sum(t["took_s"] for t in record["timings"] if t["phase"] == "RESTORING")
    assert 0 < record["resident_s"] <= restoring
    assert measure_file(str(model)).ratio >= 0.9  # and it is there still: the resident loaded it


def test_a_file_gpuswapd_may_not_read_is_named_with_what_to_do_and_skipped(world: Stack, tmp_path: Path) -> None:
    """gpuswapd without capabilities (as its unit runs it) and a 0640 file of another user and group."""
    secret = world.paths.root / "models" / "private.gguf"
    secret.write_bytes(b"GGUF" + b"\0" * 4092)
    os.chown(secret, NOBODY.pw_uid, NOBODY.pw_gid)
    secret.chmod(0o640)
    config = stack_config(world, "prefetch-unreadable",
                          resident={"files": [str(world.resident_model), str(secret)]})
    shutil.rmtree(config.parent / "state", ignore_errors=True)
    config.with_suffix(".log").unlink(missing_ok=True)
    daemon = RunningDaemon(world, config, config.parent / "gpuswapd.sock",
                           prefix=["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"])
    try:
        daemon.start()
        assert daemon.proc is not None
        caps = Path(f"/proc/{daemon.proc.pid}/status").read_text()
        assert "CapEff:\t0000000000000000" in caps
        out = daemon.ctl("plan", "--json")
        plan = json.loads(out.stdout)["plan"]
        assert out.returncode == 0, plan["problems"]
        files = plan["resident_files"]["files"]
        assert [f["path"] for f in files] == [str(world.resident_model), str(secret)]
        assert files[0]["error"] is None and files[1]["cached"] is None
        assert "may not read it (mode 0640, owner nobody" in files[1]["error"]
        assert "SupplementaryGroups=" in files[1]["error"]
        assert daemon.ctl("acquire", "--for", "1m").returncode == 0
        assert daemon.ctl("release").returncode == 0
        last = daemon.wait_phase("IDLE")["last"]
        assert [f["path"] for f in last["prefetch"]["files"]] == [str(world.resident_model)]
        skipped = [e for e in daemon.logged("resident_file_skipped") if str(secret) in e["reason"]]
        assert len(skipped) == 1  # two plans and a close: logged once
    finally:
        daemon.stop()
        secret.unlink(missing_ok=True)


def test_a_fifo_and_a_larger_file_swapped_in_after_the_measure_are_skipped_and_hold_no_worker(
        gpuswapd: Start, world: Stack) -> None:
    models = world.paths.root / "models"
    fifo, bigger = models / "swapped-fifo.gguf", models / "swapped-bigger.gguf"
    mib = 1 << 20
    for path in (fifo, bigger):
        path.unlink(missing_ok=True)
        with open(path, "wb") as f:
            f.write(b"GGUF" + b"\x5a" * (mib - 4))
            f.flush()
            os.fsync(f.fileno())  # only clean pages can be dropped from the page cache
    daemon = gpuswapd(resident={"files": [str(world.resident_model), str(fifo), str(bigger)]},
                      env={"GPUSWAPD_FAILPOINT_DELAY": "prefetch:measured=2,RESTORING:closing=5"})
    try:
        assert daemon.ctl("acquire", "--for", "1m").returncode == 0
        for path in (world.resident_model, fifo, bigger):
            evict(str(path))  # pushed out by the window (the resident is down): the close has them to read
        assert measure_file(str(fifo)).ratio < 0.5 and measure_file(str(bigger)).ratio < 0.5
        assert daemon.ctl("release").returncode == 0
        deadline = time.monotonic() + 60
        while not ((daemon.status().get("window") or {}).get("prefetch") or {}).get("files"):
            assert time.monotonic() < deadline, "the close did not measure the files"
            time.sleep(0.02)
        # Measured: now the paths name other files (the close reads them 2 s later).
        fifo.unlink()
        os.mkfifo(fifo)
        bigger.unlink()
        with open(bigger, "wb") as f:
            f.truncate(96 * mib)  # sparse: read whole, it would be 96 MiB in the page cache
        daemon.wait_phase("IDLE")
        [record] = daemon.ctl_json("history", "--limit", "1")["windows"]
        p = record["prefetch"]
        assert p["outcome"] == "done", p
        skipped = p.get("skipped") or []
        assert any(str(fifo) in why and "not a regular file" in why for why in skipped), skipped
        assert any(str(bigger) in why and "not the file measured" in why for why in skipped), skipped
        assert p["read_bytes"] <= world.resident_model.stat().st_size + 2 * mib
        assert measure_file(str(bigger)).cached < mib
        reasons = [e["reason"] for e in daemon.logged("resident_file_skipped")]
        assert any(str(fifo) in r for r in reasons) and any(str(bigger) in r for r in reasons), reasons
        assert daemon.status()["hung"]["files"]["hung"] == []

        # With the FIFO in place at the measure, two more closes: no worker held, plan answers.
        for _ in range(2):
            assert daemon.ctl("acquire", "--for", "1m").returncode == 0
            assert daemon.ctl("release").returncode == 0
            daemon.wait_phase("IDLE")
        assert daemon.status()["hung"]["files"]["hung"] == []
        files = daemon.ctl_json("plan")["plan"]["resident_files"]["files"]
        assert [f["error"] for f in files if f["path"] == str(fifo)] == [f"{fifo}: not a regular file"]
    finally:
        fifo.unlink(missing_ok=True)
        bigger.unlink(missing_ok=True)


MINCORE = ("import sys; from gpuswapd.adapters.pagecache import measure_file; f = measure_file(sys.argv[1]); "
           "print(f.error or 'measured'); sys.exit(0 if f.error is None else 1)")


def _filters(unit: Path) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith("SystemCallFilter=")]


def _under(world: Stack, name: str, filters: list[str], model: Path) -> subprocess.CompletedProcess[str]:
    """Run the measure as a transient service of the world's systemd, under these system call filters.

    systemd-run runs inside the world's namespaces (nsenter): there it finds its systemd, as PID 1.
    The world has no sysinit.target: like its other units, this one goes without default dependencies.
    """
    props = [f"--property=SystemCallFilter={f}" for f in filters]
    return subprocess.run(["nsenter", f"--target={world.systemd_pid()}", "--mount", "--pid", "--",
                           "systemd-run", "--wait", "--pipe", "--quiet", f"--unit={name}",
                           "--property=DefaultDependencies=no", "--property=SystemCallErrorNumber=EPERM",
                           f"--property=Environment=PYTHONPATH={REPO}",
                           *props, sys.executable, "-c", MINCORE, str(model)],
                          capture_output=True, text=True, timeout=60)


def test_the_units_system_call_filter_lets_gpuswapd_measure_the_files(world: Stack) -> None:
    """The real systemd applies gpuswapd.service's filter: mincore is allowed, and would not be without its line."""
    filters = _filters(REPO / "units" / "gpuswapd.service")
    assert "mincore" in filters
    allowed = _under(world, "gpuswapd-test-mincore", filters, world.resident_model)
    assert allowed.returncode == 0 and allowed.stdout.strip() == "measured", allowed.stdout + allowed.stderr
    denied = _under(world, "gpuswapd-test-no-mincore", [f for f in filters if f != "mincore"], world.resident_model)
    assert denied.returncode == 1 and "mincore: Operation not permitted" in denied.stdout, denied.stdout + denied.stderr
