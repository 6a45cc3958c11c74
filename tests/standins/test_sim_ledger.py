"""The VRAM ledger, gpu_hold.py and the fake nvidia-smi."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

GiB = 1 << 30


def smi(kit: Any, gpusim: Path | None, *args: str, script: Path | None = None) -> tuple[int, str]:
    """Run the fake nvidia-smi; return (exit code, stdout)."""
    env = {k: v for k, v in os.environ.items() if k != "GPUSIM_DIR"}
    if gpusim is not None:
        env["GPUSIM_DIR"] = str(gpusim)
    proc = subprocess.run(
        [kit.PY, str(script or kit.SIM / "nvidia_smi.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )
    return proc.returncode, proc.stdout


def holder(kit: Any, gpusim: Path, name: str) -> dict[str, Any] | None:
    """The snapshot entry of a holder, if any."""
    return next((h for h in kit.ledger.snapshot(gpusim)["holders"] if h["name"] == name), None)


def test_parse_size(kit: Any) -> None:
    """Sizes take IEC suffixes or plain bytes."""
    parse = kit.ledger.parse_size
    assert parse("21GiB") == 21 * GiB
    assert parse("512MiB") == 512 << 20
    assert parse("19.5GiB") == int(19.5 * GiB)
    assert parse("1234") == 1234
    with pytest.raises(ValueError):
        parse("21GB")


def test_claim_pid_and_release_lag(kit: Any, gpusim: Path) -> None:
    """A claim is reported with its PID; its memory lingers for the lag after death, still under that PID."""
    led = kit.ledger
    fd = led.claim(gpusim, "strata", 21 * GiB)
    snap = led.snapshot(gpusim)
    assert (snap["used_bytes"], snap["free_bytes"]) == (21 * GiB, 3 * GiB)
    assert snap["holders"] == [
        {"name": "strata", "pid": os.getpid(), "bytes": 21 * GiB, "dead_at": None}
    ]
    os.close(fd)  # the holder "exits"
    dead = led.snapshot(gpusim)
    assert dead["used_bytes"] == 21 * GiB, "VRAM release lags process exit"
    assert dead["holders"][0]["pid"] == os.getpid() and dead["holders"][0]["dead_at"] is not None
    kit.wait_until(lambda: led.snapshot(gpusim)["free_bytes"] == 24 * GiB, timeout=2)
    assert led.snapshot(gpusim)["holders"] == []


def test_oom_is_recorded_and_reset_keeps_live_holders(kit: Any, gpusim: Path) -> None:
    """An OOM raises a CUDA-like error and is recorded; reset clears it."""
    led = kit.ledger
    fd = led.claim(gpusim, "strata", 21 * GiB)
    with pytest.raises(led.OutOfMemory) as err:
        led.claim(gpusim, "hyperqwen", 4 * GiB)
    assert "CUDA error: out of memory" in str(err.value)
    assert "tried to allocate 4.00 GiB; 3.00 GiB free" in str(err.value)
    [oom] = led.ooms(gpusim)
    assert (oom["name"], oom["wanted_bytes"], oom["free_bytes"]) == ("hyperqwen", 4 * GiB, 3 * GiB)
    led.reset(gpusim)
    assert led.ooms(gpusim) == []
    assert holder(kit, gpusim, "strata") is not None
    os.close(fd)


def test_live_name_refused_lagging_memory_counts(kit: Any, gpusim: Path) -> None:
    """A live name cannot be claimed twice; lagging memory blocks a quick restart."""
    led = kit.ledger
    fd = led.claim(gpusim, "hyperqwen", 19 * GiB)
    with pytest.raises(led.HolderAlive):
        led.claim(gpusim, "hyperqwen", 1)
    os.close(fd)
    # A restart within the release lag does not fit: the old memory is still held.
    with pytest.raises(led.OutOfMemory):
        led.claim(gpusim, "hyperqwen", 19 * GiB)
    kit.wait_until(lambda: led.snapshot(gpusim)["used_bytes"] == 0, timeout=2)
    os.close(led.claim(gpusim, "hyperqwen", 19 * GiB))


def test_release_frees_at_once(kit: Any, gpusim: Path) -> None:
    """release() frees at once and closes the fd."""
    led = kit.ledger
    fd = led.claim(gpusim, "hyperqwen", 19 * GiB)
    led.release(gpusim, "hyperqwen", fd)
    assert led.snapshot(gpusim) == {
        "total_bytes": 24 * GiB,
        "used_bytes": 0,
        "free_bytes": 24 * GiB,
        "holders": [],
    }
    with pytest.raises(OSError):
        os.fstat(fd)


def test_resize_shrinks_after_the_lag_grows_only_into_room(kit: Any, gpusim: Path) -> None:
    """resize() keeps the holder and its PID; shrinking frees after the lag; growing may OOM."""
    led = kit.ledger
    fmt = "--format=csv,noheader,nounits"
    fd = led.claim(gpusim, "hyperqwen", 19 * GiB)
    led.resize(gpusim, "hyperqwen", fd, 1 * GiB)  # sleep mode: freed after the lag, like an exit
    kit.wait_until(lambda: led.snapshot(gpusim)["used_bytes"] == 1 * GiB, timeout=2)
    snap = led.snapshot(gpusim)
    assert (snap["used_bytes"], snap["free_bytes"]) == (1 * GiB, 23 * GiB)
    assert snap["holders"] == [
        {"name": "hyperqwen", "pid": os.getpid(), "bytes": 1 * GiB, "dead_at": None}
    ]
    assert smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (
        0,
        f"{os.getpid()}, 1024\n",
    )
    other = led.claim(gpusim, "strata", 10 * GiB)
    with pytest.raises(led.OutOfMemory) as err:
        led.resize(gpusim, "hyperqwen", fd, 19 * GiB)
    assert "tried to allocate 18.00 GiB; 13.00 GiB free" in str(err.value)
    assert holder(kit, gpusim, "hyperqwen")["bytes"] == 1 * GiB  # unchanged
    assert led.ooms(gpusim)[-1]["wanted_bytes"] == 18 * GiB
    # Only the claim's own fd can resize it.
    with pytest.raises(led.LedgerError):
        led.resize(gpusim, "hyperqwen", other, 0)
    with pytest.raises(led.LedgerError):
        led.resize(gpusim, "nobody", fd, 0)
    led.release(gpusim, "strata", other)
    led.resize(gpusim, "hyperqwen", fd, 19 * GiB)
    assert holder(kit, gpusim, "hyperqwen") == {
        "name": "hyperqwen",
        "pid": os.getpid(),
        "bytes": 19 * GiB,
        "dead_at": None,
    }
    os.close(fd)
    # A dead claim cannot be resized: its memory lags as usual.
    again = os.open(gpusim / "holders" / "hyperqwen.lock", os.O_RDONLY)
    with pytest.raises(led.LedgerError):
        led.resize(gpusim, "hyperqwen", again, 0)
    os.close(again)
    assert led.snapshot(gpusim)["used_bytes"] == 19 * GiB


def test_a_sleep_frees_after_the_lag_under_the_same_pid(kit: Any, gpusim: Path) -> None:
    """What a shrink lets go stays used, under the live holder's PID, for the lag; then it is free."""
    led = kit.ledger
    fmt = "--format=csv,noheader,nounits"
    led.set_lag(gpusim, 5.0)  # longer than the two nvidia-smi runs below on a loaded machine (0.5 s was not, in CI)
    fd = led.claim(gpusim, "hyperqwen", 19 * GiB)
    led.resize(gpusim, "hyperqwen", fd, 1 * GiB)
    snap = led.snapshot(gpusim)
    assert (snap["used_bytes"], snap["free_bytes"]) == (19 * GiB, 5 * GiB)
    live, freeing = snap["holders"]
    assert live == {"name": "hyperqwen", "pid": os.getpid(), "bytes": 1 * GiB, "dead_at": None}
    assert (freeing["name"], freeing["pid"], freeing["bytes"]) == ("hyperqwen", os.getpid(), 18 * GiB)
    assert freeing["dead_at"] is not None
    # nvidia-smi shows one process with everything it still holds, as a driver does.
    assert smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (0, f"{os.getpid()}, {19 * 1024}\n")
    assert smi(kit, gpusim, "--query-gpu=memory.free", fmt) == (0, f"{5 * 1024}\n")
    # Nobody else may have it yet; the engine itself may take it back at once (a quick wake).
    with pytest.raises(led.OutOfMemory):
        os.close(led.claim(gpusim, "strata", 10 * GiB))
    led.resize(gpusim, "hyperqwen", fd, 9 * GiB)
    assert led.snapshot(gpusim)["used_bytes"] == 19 * GiB and led.ooms(gpusim)[-1]["name"] == "strata"
    assert [h["bytes"] for h in led.snapshot(gpusim)["holders"]] == [9 * GiB, 10 * GiB]
    led.set_lag(gpusim, 0.5)  # (it applies to memory already being freed too)
    kit.wait_until(lambda: led.snapshot(gpusim)["free_bytes"] == 15 * GiB, timeout=2)
    assert smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (0, f"{os.getpid()}, {9 * 1024}\n")
    with pytest.raises(led.OutOfMemory):  # beyond what it is freeing, only free memory will do
        led.resize(gpusim, "hyperqwen", fd, 25 * GiB)
    os.close(fd)


def test_an_exited_process_stays_listed_for_the_lag(kit: Any, gpusim: Path, procs: Any) -> None:
    """nvidia-smi lists a dead holder under its PID until its memory is free."""
    fmt = "--format=csv,noheader,nounits"
    proc = procs.start("gpu_hold.py", "--dir", str(gpusim), "--name", "strata", "--bytes", "21GiB", "--",
                       "sleep", "30")
    kit.wait_until(lambda: holder(kit, gpusim, "strata"))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (0, f"{proc.pid}, {21 * 1024}\n")
    kit.wait_until(lambda: smi(kit, gpusim, "--query-compute-apps=pid", fmt) == (0, ""), timeout=2)
    assert kit.ledger.snapshot(gpusim)["free_bytes"] == 24 * GiB


def test_the_driver_learns_pids_and_deaths_without_being_asked(kit: Any, gpusim: Path, procs: Any) -> None:
    """``ledger.py driver`` records each holder's PID here and marks a death within its period."""
    driver = procs.start("ledger.py", "--dir", str(gpusim), "driver", "--every", "0.05")
    code = (f"import sys, time; sys.path.insert(0, {str(kit.SIM)!r}); import ledger; "
            f"fd = ledger.claim({str(gpusim)!r}, 'engine', 10 << 30); time.sleep(30)")
    claimer = procs.start_argv([kit.PY, "-c", code])
    here = os.readlink("/proc/self/ns/pid")

    def recorded() -> dict[str, Any]:
        state = json.loads((gpusim / "ledger.json").read_text())
        return state["holders"].get("engine") or {}

    kit.wait_until(lambda: recorded().get("pids", {}).get(here) == claimer.pid)
    os.kill(claimer.pid, signal.SIGKILL)
    claimer.wait()
    kit.wait_until(lambda: recorded().get("dead_at") is not None, timeout=2)
    assert driver.poll() is None
    shutil.rmtree(gpusim)  # the world goes: so does its driver
    assert driver.wait(timeout=5) == 0


def test_gpu_hold_execs_and_the_claim_follows(kit: Any, gpusim: Path, procs: Any) -> None:
    """gpu_hold.py execs the command, which keeps the claim and the PID."""
    proc = procs.start(
        "gpu_hold.py",
        "--dir",
        str(gpusim),
        "--name",
        "strata",
        "--bytes",
        "21GiB",
        "--",
        "sleep",
        "30",
    )
    entry = kit.wait_until(lambda: holder(kit, gpusim, "strata"))
    # exec keeps the PID, so the ledger names the program itself, not a wrapper.
    assert entry["pid"] == proc.pid
    kit.wait_until(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep"))
    assert holder(kit, gpusim, "strata")["pid"] == proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert holder(kit, gpusim, "strata")["dead_at"] is not None


def test_gpu_hold_oom_does_not_run_the_command(kit: Any, gpusim: Path, tmp_path: Path) -> None:
    """gpu_hold.py out of memory: CUDA-like message, exit 1, no exec."""
    fd = kit.ledger.claim(gpusim, "hyperqwen", 19 * GiB)
    marker = tmp_path / "ran"
    proc = subprocess.run(
        [
            kit.PY,
            str(kit.SIM / "gpu_hold.py"),
            "--dir",
            str(gpusim),
            "--name",
            "strata",
            "--bytes",
            "21GiB",
            "--",
            "touch",
            str(marker),
        ],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert proc.returncode == 1
    assert "cudaMalloc failed: out of memory" in proc.stderr
    assert "CUDA error: out of memory" in proc.stderr
    assert not marker.exists()
    assert kit.ledger.ooms(gpusim)[0]["name"] == "strata"
    os.close(fd)


def test_claim_inherited_over_fork_names_the_survivor(kit: Any, gpusim: Path) -> None:
    """A claim passed to a child over fork is reported with the child's PID."""
    # The claimer hands its fd to a child and exits: /proc/locks still names the claimer,
    # the ledger must name the child that actually holds the lock.
    code = (
        "import subprocess, sys\n"
        f"sys.path.insert(0, {str(kit.SIM)!r})\n"
        "import ledger\n"
        f"fd = ledger.claim({str(gpusim)!r}, 'strata', 21 << 30)\n"
        "child = subprocess.Popen(['sleep', '30'], pass_fds=(fd,), stdout=subprocess.DEVNULL,\n"
        "                         stderr=subprocess.DEVNULL)\n"
        "print(child.pid)\n"
    )
    out = subprocess.run([kit.PY, "-c", code], capture_output=True, text=True, timeout=10)
    child = int(out.stdout)
    try:
        entry = holder(kit, gpusim, "strata")
        assert entry is not None and entry["dead_at"] is None
        assert entry["pid"] == child
    finally:
        os.kill(child, signal.SIGKILL)
    kit.wait_until(lambda: holder(kit, gpusim, "strata")["dead_at"] is not None)


def test_holder_in_another_pid_namespace(kit: Any, gpusim: Path, procs: Any) -> None:
    """A holder in a child PID namespace is reported with the PID seen from here."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare")
    proc = subprocess.Popen(
        [
            unshare,
            "--pid",
            "--fork",
            "--mount-proc",
            kit.PY,
            str(kit.SIM / "gpu_hold.py"),
            "--dir",
            str(gpusim),
            "--name",
            "strata",
            "--bytes",
            "21GiB",
            "--",
            "sleep",
            "30",
        ],
        stderr=subprocess.PIPE,
    )
    procs.started.append(proc)
    # A timeout, or an unshare that failed, is a failure: the test world itself runs on unshare --pid.
    entry = kit.wait_until(lambda: holder(kit, gpusim, "strata") or proc.poll() is not None)
    assert proc.poll() is None, f"unshare --pid failed: {proc.stderr.read().decode()[:200]}"
    # Inside, the holder is PID 1; here it must be the PID this namespace knows.
    pid = entry["pid"]
    assert pid not in (None, 1, proc.pid)
    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    assert argv0 in (b"sleep", b"/usr/bin/sleep")
    os.kill(pid, signal.SIGKILL)  # PID 1 of the namespace: the namespace ends
    proc.wait(timeout=5)
    # Its memory is being freed: still listed, under the PID this namespace knew it by.
    assert holder(kit, gpusim, "strata")["pid"] == pid
    kit.wait_until(lambda: holder(kit, gpusim, "strata") is None, timeout=2)


def test_ledger_cli(kit: Any, tmp_path: Path) -> None:
    """ledger.py init/show/ooms work from the command line."""
    d = tmp_path / "cli"
    env = {**os.environ, "GPUSIM_DIR": str(d)}
    run = [kit.PY, str(kit.SIM / "ledger.py")]
    subprocess.run([*run, "init", "--total", "24GiB", "--lag", "1.5"], env=env, check=True)
    show = subprocess.run([*run, "show"], env=env, capture_output=True, text=True, check=True)
    assert '"free_bytes": 25769803776' in show.stdout
    ooms = subprocess.run(
        [*run, "--dir", str(d), "ooms"], capture_output=True, text=True, check=True
    )
    assert ooms.stdout.strip() == "[]"
    missing = subprocess.run(
        [*run, "--dir", str(tmp_path / "none"), "show"], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "init" in missing.stderr


# -- nvidia-smi


def test_smi_memory_queries(kit: Any, gpusim: Path) -> None:
    """--query-gpu memory fields in any order, with and without header/units."""
    fd = kit.ledger.claim(gpusim, "strata", 21 * GiB)
    fmt = "--format=csv,noheader,nounits"
    assert smi(kit, gpusim, "--query-gpu=memory.used,memory.total,memory.free", fmt) == (
        0,
        "21504, 24576, 3072\n",
    )
    assert smi(kit, gpusim, "--query-gpu=memory.free,memory.used", fmt) == (0, "3072, 21504\n")
    assert smi(kit, gpusim, "--query-gpu=index,name", fmt) == (0, "0, NVIDIA GeForce RTX 3090\n")
    assert smi(kit, gpusim, "--query-gpu=memory.used", "--format=csv") == (
        0,
        "memory.used [MiB]\n21504 MiB\n",
    )
    assert smi(kit, gpusim, "-i", "0", "--query-gpu=memory.free", fmt) == (0, "3072\n")
    assert smi(kit, gpusim, "--id=0", "--query-gpu=memory.free", fmt) == (0, "3072\n")
    os.close(fd)


def test_smi_compute_apps(kit: Any, gpusim: Path) -> None:
    """--query-compute-apps lists holders; lagging memory stays listed under its process."""
    fd = kit.ledger.claim(gpusim, "strata", 21 * GiB)
    fmt = "--format=csv,noheader,nounits"
    assert smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (
        0,
        f"{os.getpid()}, 21504\n",
    )
    _, out = smi(kit, gpusim, "--query-compute-apps=pid,used_memory", "--format=csv")
    assert out == f"pid, used_gpu_memory [MiB]\n{os.getpid()}, 21504 MiB\n"
    os.close(fd)
    # Lagging memory is still used, and listed under the process that held it, as a driver does.
    assert smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (0, f"{os.getpid()}, 21504\n")
    assert smi(kit, gpusim, "--query-gpu=memory.used", fmt) == (0, "21504\n")
    kit.wait_until(lambda: smi(kit, gpusim, "--query-compute-apps=pid,used_memory", fmt) == (0, ""), timeout=2)


def test_smi_list_table_and_errors(kit: Any, gpusim: Path) -> None:
    """-L, the summary table, and the real tool's errors and exit codes."""
    code, out = smi(kit, gpusim, "-L")
    assert code == 0 and out.startswith("GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-")
    fd = kit.ledger.claim(gpusim, "strata", 21 * GiB)
    code, out = smi(kit, gpusim)
    assert code == 0 and "21504MiB /  24576MiB" in out and str(os.getpid()) in out
    os.close(fd)
    assert smi(kit, gpusim, "-i", "1", "--query-gpu=memory.used", "--format=csv") == (
        6,
        "No devices were found\n",
    )
    assert smi(kit, gpusim, "--id=3", "-L")[0] == 6
    code, out = smi(kit, gpusim, "--bogus")
    assert code == 2 and "--bogus is not recognized" in out
    code, out = smi(kit, gpusim, "--query-gpu=memory.bogus", "--format=csv")
    assert code == 2 and 'Field "memory.bogus" is not a valid field to query.' in out


def test_smi_driver_failures(kit: Any, gpusim: Path) -> None:
    """No ledger or a fault file: the driver failure message and exit 9."""
    code, out = smi(kit, None, "-L")
    assert code == 9 and "couldn't communicate with the NVIDIA driver" in out
    (gpusim / "nvidia-smi.fail").write_text("Unable to determine the device handle for GPU0\n")
    assert smi(kit, gpusim, "-L") == (9, "Unable to determine the device handle for GPU0\n")
    (gpusim / "nvidia-smi.fail").write_text("")
    code, out = smi(kit, gpusim, "-L")
    assert code == 9 and out.startswith("NVIDIA-SMI has failed")


def test_smi_dir_from_file_next_to_script(kit: Any, gpusim: Path, tmp_path: Path) -> None:
    """Without GPUSIM_DIR, gpusim.dir next to an nvidia-smi symlink is used."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("nvidia_smi.py", "ledger.py"):
        shutil.copy(kit.SIM / name, bindir / name)
    (bindir / "gpusim.dir").write_text(f"{gpusim}\n")
    link = bindir / "nvidia-smi"
    link.symlink_to(bindir / "nvidia_smi.py")
    fd = kit.ledger.claim(gpusim, "strata", 1 * GiB)
    assert smi(
        kit, None, "--query-gpu=memory.used", "--format=csv,noheader,nounits", script=link
    ) == (0, "1024\n")
    os.close(fd)


def test_smi_is_fast_enough_to_poll(kit: Any, gpusim: Path) -> None:
    """One query is quick enough to poll."""
    start = time.monotonic()
    assert smi(kit, gpusim, "--query-gpu=memory.free", "--format=csv,noheader,nounits")[0] == 0
    assert time.monotonic() - start < 2


# -- a box with two cards


def test_two_cards_count_claim_and_fail_apart(kit: Any, gpusim: Path) -> None:
    """Each card has its own memory: a full GPU 0 leaves GPU 1 free, and OOMs say which GPU."""
    led = kit.ledger
    led.set_cards(gpusim, 2)
    strata = led.claim(gpusim, "strata", 21 * GiB)
    strata1 = led.claim(gpusim, "strata1", 21 * GiB, 1)
    engine = led.claim(gpusim, "hyperqwen1", 2 * GiB, 1)
    assert [(s["free_bytes"], [h["name"] for h in s["holders"]]) for s in led.snapshot_cards(gpusim)] == [
        (3 * GiB, ["strata"]), (1 * GiB, ["strata1", "hyperqwen1"])]
    assert led.snapshot(gpusim) == led.snapshot_cards(gpusim)[0]
    with pytest.raises(led.OutOfMemory) as err:
        led.claim(gpusim, "big", 2 * GiB, 1)
    assert "GPU 1: tried to allocate 2.00 GiB; 1.00 GiB free" in str(err.value)
    assert led.ooms(gpusim)[-1]["card"] == 1
    led.resize(gpusim, "hyperqwen1", engine, 1 * GiB)
    assert led.snapshot(gpusim, 1)["free_bytes"] == 1 * GiB  # what it let go comes free after the lag
    kit.wait_until(lambda: led.snapshot(gpusim, 1)["free_bytes"] == 2 * GiB, timeout=2)
    with pytest.raises(led.LedgerError, match="no GPU 2"):
        led.claim(gpusim, "nowhere", 1, 2)
    with pytest.raises(led.LedgerError, match="GPU 1 still has holders"):
        led.set_cards(gpusim, 1)
    for fd in (strata1, engine):
        os.close(fd)
    led.reset(gpusim, cards=1)  # dead holders go first, then the card
    assert len(led.snapshot_cards(gpusim)) == 1
    # A one-card ledger is written as it always was: no card on GPU 0's holders.
    assert "card" not in json.loads((gpusim / "ledger.json").read_text())["holders"]["strata"]
    os.close(strata)


def test_smi_of_two_cards_by_index_uuid_and_bus(kit: Any, gpusim: Path, procs: Any) -> None:
    """nvidia-smi reports each card, -i picks one; gpu_hold --card claims on the card it names."""
    kit.ledger.set_cards(gpusim, 2)
    fd = kit.ledger.claim(gpusim, "strata", 21 * GiB)
    proc = procs.start("gpu_hold.py", "--dir", str(gpusim), "--card", "1", "--name", "strata1", "--bytes", "20GiB",
                       "--", "sleep", "30")
    kit.wait_until(lambda: kit.ledger.snapshot(gpusim, 1)["holders"])
    fmt = "--format=csv,noheader,nounits"
    assert smi(kit, gpusim, "--query-gpu=index,count,memory.used,memory.free", fmt) == (
        0, "0, 2, 21504, 3072\n1, 2, 20480, 4096\n")
    assert smi(kit, gpusim, "-i", "1", "--query-gpu=memory.used,memory.total,memory.free", fmt) == (
        0, "20480, 24576, 4096\n")
    assert smi(kit, gpusim, "-i", "1", "--query-compute-apps=pid,used_memory", fmt) == (0, f"{proc.pid}, 20480\n")
    assert smi(kit, gpusim, "-i", "0", "--query-compute-apps=pid,used_memory", fmt) == (0, f"{os.getpid()}, 21504\n")
    _, uuid1 = smi(kit, gpusim, "-i", "1", "--query-gpu=uuid", fmt)
    assert uuid1.strip() != smi(kit, gpusim, "-i", "0", "--query-gpu=uuid", fmt)[1].strip()
    assert smi(kit, gpusim, "-i", uuid1.strip(), "--query-gpu=index", fmt) == (0, "1\n")
    assert smi(kit, gpusim, "--id=00000000:02:00.0", "--query-gpu=index", fmt) == (0, "1\n")
    assert smi(kit, gpusim, "-L")[1].count("GPU ") == 2
    assert smi(kit, gpusim, "-i", "2", "-L") == (6, "No devices were found\n")
    code, table = smi(kit, gpusim)
    assert code == 0 and "|   1  NVIDIA GeForce RTX 3090" in table and f"|    1   N/A  N/A  {proc.pid:>9}" in table
    os.close(fd)
