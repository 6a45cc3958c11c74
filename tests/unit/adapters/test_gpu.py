"""GPU probes: nvidia-smi against the ledger-backed fake and broken fakes; NVML error mapping."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpuswapd.adapters import gpu
from gpuswapd.adapters.gpu import GpuProcess, NvmlProbe, SmiProbe, make_probe
from gpuswapd.config import GpuConfig
from gpuswapd.errors import GpuProbeError

SIM = Path(__file__).resolve().parents[2] / "stack" / "standins"
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
MiB = 1 << 20
GiB = 1 << 30


def script(path: Path, body: str) -> str:
    """Write an executable shell script and return its path."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def wait_for(what: str, check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- nvidia-smi -----------------------------------------------------------------------------


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh 24 GiB ledger with a 0.5 s release lag, named by $GPUSIM_DIR."""
    directory = tmp_path / "gpu"
    subprocess.run([PY, str(SIM / "ledger.py"), "init", "--dir", str(directory), "--total", "24GiB",
                    "--lag", "0.5"], check=True, timeout=30)
    monkeypatch.setenv("GPUSIM_DIR", str(directory))
    return directory


@pytest.fixture
def fake_smi(tmp_path: Path) -> str:
    """The simulator's nvidia-smi, as an executable (it has no shebang of its own)."""
    return script(tmp_path / "nvidia-smi", f'exec {PY} {SIM / "nvidia_smi.py"} "$@"')


@pytest.fixture
def holder(ledger: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process holding 1 GiB of the simulated GPU (killed by PID afterwards)."""
    proc = subprocess.Popen([PY, str(SIM / "gpu_hold.py"), "--dir", str(ledger), "--name", "x",
                             "--bytes", "1GiB", "--", "sleep", "30"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def test_smi_reads_the_ledger(fake_smi: str, ledger: Path) -> None:
    reading = SmiProbe(0, fake_smi).read()
    assert (reading.total_bytes, reading.used_bytes, reading.free_bytes) == (24 * GiB, 0, 24 * GiB)
    assert reading.processes == ()


def set_lag(ledger: Path, seconds: float) -> None:
    subprocess.run([PY, str(SIM / "ledger.py"), "lag", "--dir", str(ledger), str(seconds)], check=True, timeout=30)


def test_smi_sees_a_holder_and_its_release_lag(
    fake_smi: str, ledger: Path, holder: subprocess.Popen[bytes]
) -> None:
    probe = SmiProbe(0, fake_smi)
    # Two nvidia-smi runs are not one snapshot: wait until both have seen the claim.
    reading = wait_for("the holder's claim", lambda: (r := probe.read()).processes and r.used_bytes and r)
    assert reading.processes == (GpuProcess(pid=holder.pid, used_bytes=GiB),)
    assert (reading.used_bytes, reading.free_bytes) == (GiB, 23 * GiB)

    # A lag longer than one read's two nvidia-smi runs on a loaded machine (0.5 s was not, in CI).
    set_lag(ledger, 5.0)
    holder.kill()
    holder.wait(5)
    lagging = probe.read()
    # The process is gone, its memory is not (the driver's release lag): still listed under its pid.
    assert lagging.processes == (GpuProcess(pid=holder.pid, used_bytes=GiB),)
    assert lagging.used_bytes == GiB
    set_lag(ledger, 0.0)  # the lag applies at once to memory already lagging
    wait_for("the memory to come free", lambda: probe.read().used_bytes == 0)


def test_smi_driver_failure_names_the_exit_and_message(fake_smi: str, ledger: Path) -> None:
    (ledger / "nvidia-smi.fail").write_text("")
    with pytest.raises(GpuProbeError) as caught:
        SmiProbe(0, fake_smi).read()
    message = caught.value.message
    assert "exit 9" in message
    assert "couldn't communicate with the NVIDIA driver" in message
    assert 'probe = "none"' in message


def test_smi_failure_on_stderr(tmp_path: Path) -> None:
    message = "Failed to initialize NVML: Driver/library version mismatch"
    smi = script(tmp_path / "smi", f'echo "{message}" >&2; exit 9')
    with pytest.raises(GpuProbeError, match=r"exit 9\): Failed to initialize NVML: Driver/library"):
        SmiProbe(0, smi).read()


def test_smi_wrong_index(fake_smi: str, ledger: Path) -> None:
    with pytest.raises(GpuProbeError, match=r"-i 3 .*exit 6\): No devices were found"):
        SmiProbe(3, fake_smi).read()


@pytest.mark.parametrize(
    "output", ["garbage", "[N/A], 24576, [N/A]", "1, 2", "1, 2, 3\n4, 5, 6", ""]
)
def test_smi_unreadable_memory(tmp_path: Path, output: str) -> None:
    smi = script(tmp_path / "smi", f"printf '%s\\n' '{output}'")
    with pytest.raises(GpuProbeError, match="printed something unreadable"):
        SmiProbe(0, smi).read()


def test_smi_unreadable_processes(tmp_path: Path) -> None:
    smi = script(tmp_path / "smi", """case "$3" in
  --query-gpu=*) echo "100, 24576, 24476" ;;
  *) echo "pid?, 100" ;;
esac""")
    with pytest.raises(GpuProbeError, match=r"query-compute-apps.*unreadable: 'pid\?, 100'"):
        SmiProbe(0, smi).read()


def test_smi_unknown_process_memory_counts_as_zero(tmp_path: Path) -> None:
    smi = script(tmp_path / "smi", """case "$3" in
  --query-gpu=*) echo "20000, 24576, 4576" ;;
  *) printf '4242, 19000\\n4343, [N/A]\\n' ;;
esac""")
    reading = SmiProbe(0, smi).read()
    assert reading.used_bytes == 20000 * MiB
    assert reading.processes == (GpuProcess(4242, 19000 * MiB), GpuProcess(4343, 0))


def test_smi_passes_the_documented_arguments(tmp_path: Path) -> None:
    log = tmp_path / "argv"
    smi = script(tmp_path / "smi", f"""echo "$@" >> {log}
case "$3" in --query-gpu=*) echo "1, 2, 1" ;; esac""")
    SmiProbe(2, smi).read()
    # The two queries run side by side: either may log first.
    assert sorted(log.read_text().splitlines()) == [
        "-i 2 --query-compute-apps=pid,used_memory --format=csv,noheader,nounits",
        "-i 2 --query-gpu=memory.used,memory.total,memory.free --format=csv,noheader,nounits",
    ]


def test_smi_missing_binary(tmp_path: Path) -> None:
    expected = r"cannot run '.*no-such-smi': not found.*\[gpu\] nvidia_smi"
    with pytest.raises(GpuProbeError, match=expected):
        SmiProbe(0, str(tmp_path / "no-such-smi")).read()


def test_smi_not_executable(tmp_path: Path) -> None:
    path = tmp_path / "smi"
    path.write_text("echo hi\n")
    with pytest.raises(GpuProbeError, match="Permission denied"):
        SmiProbe(0, str(path)).read()


def test_smi_timeout_kills_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    smi = script(tmp_path / "smi", f"sleep 30 & echo $! > {pidfile}; wait")
    started = time.monotonic()
    with pytest.raises(GpuProbeError, match=r"did not answer within 0.5s"):
        SmiProbe(0, smi, timeout=0.5).read()
    assert time.monotonic() - started < 3
    child = int(pidfile.read_text())
    wait_for("the hung command's child to die", lambda: not _alive(child), 5)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# -- NVML: our mapping of its answers and errors (no NVIDIA driver on this machine) ---------


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Stand-ins for the pynvml calls, counting nvmlInit; NVML starts uninitialised."""
    calls = SimpleNamespace(init=0)
    monkeypatch.setattr(gpu._Nvml, "_ready", False)

    def init() -> None:
        calls.init += 1

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: ("handle", index))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda h: SimpleNamespace(total=24 * GiB, used=20 * GiB, free=4 * GiB))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: [
        SimpleNamespace(pid=4242, usedGpuMemory=19 * GiB),
        SimpleNamespace(pid=4343, usedGpuMemory=None),  # NVML_VALUE_NOT_AVAILABLE
    ])
    return calls


def test_nvml_reading(nvml: SimpleNamespace) -> None:
    reading = NvmlProbe(0).read()
    assert reading.total_bytes == 24 * GiB
    assert (reading.used_bytes, reading.free_bytes) == (20 * GiB, 4 * GiB)
    assert reading.processes == (GpuProcess(4242, 19 * GiB), GpuProcess(4343, 0))


def test_nvml_initialises_once_across_threads(nvml: SimpleNamespace) -> None:
    probes = [NvmlProbe(0), NvmlProbe(0)]
    threads = [threading.Thread(target=probes[i % 2].read) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert nvml.init == 1


def test_nvml_init_failure(nvml: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with pytest.raises(GpuProbeError) as caught:
        NvmlProbe(0).read()
    assert "cannot read GPU 0 through NVML: Driver Not Loaded" in caught.value.message
    assert '[gpu] probe = "nvidia-smi"' in caught.value.message
    assert '"none"' in caught.value.message
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)
    assert not gpu._Nvml._ready  # the next read tries again


def test_nvml_no_such_gpu_then_recovers(
    nvml: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_gpu(index: int) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    probe = NvmlProbe(1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", no_gpu)
    with pytest.raises(GpuProbeError, match="cannot read GPU 1 through NVML: Invalid Argument"):
        probe.read()
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: ("handle", index))
    assert probe.read().total_bytes == 24 * GiB


def test_nvml_lost_gpu_drops_the_handle(
    nvml: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    handles: list[int] = []
    def handle(index: int) -> int:
        handles.append(index)
        return index

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    probe = NvmlProbe(0)
    probe.read()

    def lost(handle: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    with monkeypatch.context() as m:
        m.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lost)
        with pytest.raises(GpuProbeError, match="GPU is lost"):
            probe.read()
    probe.read()
    assert handles == [0, 0]


def test_nvml_without_a_driver_here() -> None:
    """On this machine (no NVIDIA driver) the real pynvml fails, and we say what to do."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - a machine with a GPU
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here")
    with pytest.raises(GpuProbeError, match=r'through NVML: .*\[gpu\] probe = "nvidia-smi"'):
        NvmlProbe(0).read()


# -- make_probe -----------------------------------------------------------------------------


def test_make_probe() -> None:
    nvml = make_probe(GpuConfig(probe="nvml", index=1))
    assert isinstance(nvml, NvmlProbe) and nvml.index == 1
    smi = make_probe(GpuConfig(probe="nvidia-smi", index=2, nvidia_smi="/opt/bin/nvidia-smi"))
    assert isinstance(smi, SmiProbe) and (smi.index, smi.binary) == (2, "/opt/bin/nvidia-smi")
    assert make_probe(GpuConfig(probe="none")) is None
