from pathlib import Path

import pytest

from gpuswapd.adapters.unitnames import unit_from_cgroup, unit_from_path


def _proc(tmp_path: Path, text: str) -> Path:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(text)
    return tmp_path


@pytest.mark.parametrize(("cgroup", "unit"), [
    ("0::/system.slice/consumer.service\n", "consumer.service"),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope"),
    # a systemd in a container or another PID namespace: a prefix before its own tree
    ("0::/machine.slice/box.scope/system.slice/eval.service/payload\n", "eval.service"),
    ("9:name=systemd:/system.slice/strata.service\n4:memory:/x\n0::/\n", "strata.service"),
    ("0::/docker/0123abcd\n", None),
    ("0::/init.scope\n", None),
    ("0::/\n", None),
])
def test_unit_from_cgroup(tmp_path: Path, cgroup: str, unit: str | None) -> None:
    assert unit_from_cgroup(42, _proc(tmp_path, cgroup)) == unit


def test_unreadable_cgroup_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        unit_from_cgroup(7, tmp_path)


def test_unit_from_path() -> None:
    assert unit_from_path("/org/freedesktop/systemd1/unit/strata_2eservice") == "strata.service"
    assert unit_from_path("/org/freedesktop/systemd1/unit/agent_2dtriage_2etimer") == "agent-triage.timer"


def test_a_live_process_whose_cgroup_names_no_unit_is_in_the_root_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    # None would say it has exited (the window counts an exited process's memory as coming free).
    systemd = pytest.importorskip("gpuswapd.adapters.systemd")  # pydbus: makepkg's check() runs without it
    adapter = systemd.Systemd()
    monkeypatch.setattr(systemd, "unit_from_cgroup", lambda pid: None)  # "0::/", "0::/docker/0123abcd"
    assert adapter.unit_of_pid(42) == "-.slice"
    monkeypatch.setattr(systemd, "unit_from_cgroup", lambda pid: "strata.service")
    assert adapter.unit_of_pid(42) == "strata.service"
