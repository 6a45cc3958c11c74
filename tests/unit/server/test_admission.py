"""Connection caps and who owns a lease: pure logic, no socket."""

from __future__ import annotations

from gpuswapd.adapters.unitnames import service_prefixes
from gpuswapd.leases import Lease
from gpuswapd.server.admission import Admission
from gpuswapd.server.peers import Peer

ROOT, MEMBER, OTHER = Peer(1, 0, 0), Peer(2, 1000, 1000), Peer(3, 1001, 1001)


def _admission(max_clients: int = 10, per_uid: int = 4, reserved: int = 3) -> Admission:
    return Admission(max_clients, per_uid, reserved, privileged=lambda p: p.uid == MEMBER.uid)


def test_one_user_gets_at_most_its_share_and_root_has_no_per_user_cap() -> None:
    a = _admission()
    assert [a.admit(OTHER) for _ in range(4)] == [None] * 4
    refusal = a.admit(OTHER)
    assert refusal is not None and "max_clients_per_uid = 4" in refusal and "uid 1001" in refusal
    assert [a.admit(ROOT) for _ in range(6)] == [None] * 6  # 10 open: the whole of max_clients
    assert a.open == 10


def test_the_reserve_is_kept_for_root_and_the_group() -> None:
    a = _admission(max_clients=10, per_uid=10, reserved=3)
    for _ in range(7):
        assert a.admit(OTHER) is None
    refusal = a.admit(OTHER)
    assert refusal is not None and "kept for root and the group" in refusal
    assert a.admit(MEMBER) is None and a.admit(MEMBER) is None and a.admit(ROOT) is None
    assert a.admit(ROOT) is not None  # the whole limit reached: even root waits
    a.leave(OTHER)
    assert a.admit(ROOT) is None


def test_leaving_gives_the_place_back() -> None:
    a = _admission(per_uid=1)
    assert a.admit(OTHER) is None
    assert a.admit(OTHER) is not None
    a.leave(OTHER)
    assert a.admit(OTHER) is None and a.open == 1


def test_a_lease_is_its_units_or_its_uids_and_root_may_end_any() -> None:
    unit_lease = Lease("a", "job.service", 0, 1, unit="job.service", uid=0)
    uid_lease = Lease("b", "alice[42]", 0, 1, unit=None, uid=1000)
    service = Peer(9, 1000, 1000, unit="job.service")
    assert service.owns(unit_lease) and not MEMBER.owns(unit_lease)
    assert MEMBER.owns(uid_lease) and not OTHER.owns(uid_lease)
    assert service.owns(uid_lease)  # a lease bound to no unit is its uid's, whoever of that uid asks
    assert ROOT.owns(unit_lease) and ROOT.owns(uid_lease)


def test_cgroup_paths_are_read_outermost_service_first() -> None:
    assert service_prefixes("/system.slice/job.service") == [("job.service", "/system.slice/job.service")]
    nested = "/user.slice/user-1000.slice/user@1000.service/app.slice/strata.service"
    assert service_prefixes(nested) == [
        ("user@1000.service", "/user.slice/user-1000.slice/user@1000.service"),
        ("strata.service", nested),
    ]
    assert service_prefixes("/user.slice/user-1000.slice/session-3.scope") == []
