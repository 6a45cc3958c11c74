from pathlib import Path

import pytest

from gpuswapd.adapters.unitnames import Owner, cgroup_of, owner_of, unit_from_path
from gpuswapd.errors import SystemdError, UnitNotFound

# What a system manager says of its units' ControlGroup. The test world's systemd (another PID
# namespace, not the host's PID 1) has its tree under a prefix, and reports its units' cgroups with it.
PREFIX = "/machine.slice/box.scope"
MANAGER = {
    "strata.service": "/system.slice/strata.service",
    "consumer.service": "/system.slice/consumer.service",
    "user@1000.service": "/user.slice/user-1000.slice/user@1000.service",
    "session-3.scope": "/user.slice/user-1000.slice/session-3.scope",
    "eval.service": f"{PREFIX}/system.slice/eval.service",
    "box.scope": "/elsewhere/box.scope",  # a scope of that name, but not the prefix above
}


class Manager:
    """A system manager's ControlGroup answers, counted."""

    def __init__(self, units: dict[str, str]) -> None:
        self.units = units
        self.asked: list[str] = []

    def __call__(self, unit: str) -> str | None:
        self.asked.append(unit)
        if unit not in self.units:
            raise UnitNotFound(f"no unit {unit}")
        return self.units[unit]


@pytest.mark.parametrize(("cgroup", "unit"), [
    ("/system.slice/consumer.service", "consumer.service"),
    ("/system.slice/strata.service/payload", "strata.service"),  # a cgroup made inside it is still its
    ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),
    # a systemd in a container or another PID namespace: a prefix before its own tree
    (f"{PREFIX}/system.slice/eval.service/payload", "eval.service"),
    # a user's own manager: everything under it is a stranger's, whatever it is called
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/strata.service", "user@1000.service"),
    # a service made inside another service's delegated tree is that service's
    ("/system.slice/consumer.service/strata.service", "consumer.service"),
    ("/docker/0123abcd", None),
    ("/", None),
    # looks like a unit that exists, but the manager's unit has another cgroup
    ("/forged/strata.service", None),
])
def test_the_outermost_unit_the_manager_confirms_owns_the_process(cgroup: str, unit: str | None) -> None:
    owner = owner_of(cgroup, Manager(MANAGER))
    assert owner.unit == unit
    assert owner.stranger == (unit is None or unit.startswith("user@"))


def test_a_user_managers_strata_is_a_strangers_and_never_named_as_a_unit() -> None:
    owner = owner_of("/user.slice/user-1000.slice/user@1000.service/app.slice/strata.service", Manager(MANAGER))
    assert owner.user_manager and owner.stranger
    assert owner.name.startswith("a stranger's") and "user@1000.service" in owner.name
    assert not owner.name.endswith((".service", ".scope"))
    nobody = owner_of("/docker/0123abcd", Manager(MANAGER))
    assert nobody.name == "a stranger's: no system unit owns cgroup /docker/0123abcd"
    assert Owner("strata.service", "/system.slice/strata.service").name == "strata.service"


def test_what_the_manager_confirmed_is_kept_by_cgroup_path() -> None:
    ask, known = Manager(MANAGER), {}  # type: dict[str, str]
    for _ in range(3):
        assert owner_of("/system.slice/strata.service", ask, known).unit == "strata.service"
        assert owner_of("/system.slice/strata.service/x", ask, known).unit == "strata.service"
    assert ask.asked == ["strata.service"]
    assert known == {"/system.slice/strata.service": "strata.service"}
    # what was not confirmed is asked again (a unit may start meanwhile)
    owner_of("/forged/strata.service", ask, known)
    owner_of("/forged/strata.service", ask, known)
    assert ask.asked.count("strata.service") == 3


def test_a_manager_that_cannot_say_is_not_taken_for_a_no() -> None:
    def down(unit: str) -> str | None:
        raise SystemdError("the bus is gone")

    with pytest.raises(SystemdError):
        owner_of("/system.slice/strata.service", down)


def _proc(tmp_path: Path, text: str) -> Path:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(text)
    return tmp_path


@pytest.mark.parametrize(("text", "cgroup"), [
    ("0::/system.slice/consumer.service\n", "/system.slice/consumer.service"),
    ("9:name=systemd:/system.slice/strata.service\n4:memory:/x\n0::/\n", "/system.slice/strata.service"),
    ("0::/\n", None),
])
def test_cgroup_of(tmp_path: Path, text: str, cgroup: str | None) -> None:
    assert cgroup_of(42, _proc(tmp_path, text)) == cgroup


def test_unreadable_cgroup_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        cgroup_of(7, tmp_path)


def test_unit_from_path() -> None:
    assert unit_from_path("/org/freedesktop/systemd1/unit/strata_2eservice") == "strata.service"
    assert unit_from_path("/org/freedesktop/systemd1/unit/agent_2dtriage_2etimer") == "agent-triage.timer"


def test_a_live_process_no_system_unit_owns_is_a_strangers(monkeypatch: pytest.MonkeyPatch) -> None:
    # None would say it has exited (the window counts an exited process's memory as coming free).
    systemd = pytest.importorskip("gpuswapd.adapters.systemd")  # pydbus: makepkg's check() runs without it
    adapter = systemd.Systemd()
    monkeypatch.setattr(adapter, "control_group", Manager(MANAGER))
    for cgroup, name in [
        (None, "a stranger's: no system unit owns cgroup /"),  # "0::/"
        ("/docker/0123abcd", "a stranger's: no system unit owns cgroup /docker/0123abcd"),
        ("/system.slice/strata.service", "strata.service"),
    ]:
        monkeypatch.setattr(systemd, "cgroup_of", lambda pid, c=cgroup: c)
        assert adapter.unit_of_pid(42) == name
    monkeypatch.setattr(systemd, "cgroup_of",
                        lambda pid: "/user.slice/user-1000.slice/user@1000.service/app.slice/strata.service")
    assert adapter.unit_of_pid(42).startswith("a stranger's: under user@1000.service")
