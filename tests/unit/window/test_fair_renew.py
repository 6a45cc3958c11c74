"""Renewals and preemption under the fairness rule and never_stop, on in-process fakes.

A lease that keeps renewing cannot keep a waiting profile out past ``daemon.fair_after``; a
preemption stops only units bound to their own leases, never those of ``daemon.never_stop``
(cron's), retries a stop that fails, and redoes one a restart interrupted.
"""

from __future__ import annotations

import asyncio
import time

from gpuswapd import clock
from gpuswapd.record import Preemption
from tests.fakes import FakeUnit, running, settle
from tests.unit.conftest import resident_back, run, until, world


def test_a_lease_that_keeps_renewing_cannot_starve_a_waiting_profile() -> None:
    fw = world(fair_after="300ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            held = await w.acquire("chat", 0.2)
            renewed, claim = await w.renew(held.id, 3600)  # nobody waits: as asked
            assert claim is None and renewed.expires_at > clock.wall() + 3000
            renewed, claim = await w.renew(held.id, 0.2)  # a renewal may shorten, as before
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            since = w.queue.queued()[0].since
            started = time.monotonic()
            caps = []
            while not waiting.done():  # the holder renews for an hour, every 50 ms
                try:
                    lease, claim = await w.renew(held.id, 3600)
                except Exception:  # its lease ran out: the window closed under it
                    break
                caps.append(claim is not None)
                assert lease.expires_at <= since + 0.3 + 1e-6, "a renewal went past the fair claim"
                await asyncio.sleep(0.05)
            eval_lease = await waiting
            assert time.monotonic() - started < 5
            assert all(caps) and caps, caps
            assert w.record is not None and w.record.profile == "eval"
            await w.release(eval_lease.id)
            await settle(w)
            assert resident_back(fw)

    run(main())


def test_a_lease_already_granted_past_the_claim_keeps_its_expiry_and_is_never_shortened() -> None:
    fw = world(fair_after="50ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            held = await w.acquire("chat", 600)
            granted = held.expires_at
            waiting = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            lease, claim = await w.renew(held.id, 3600)
            assert claim is not None and claim.holder == "eval" and lease.expires_at == granted
            lease, claim = await w.renew(held.id, 10)  # shorter than granted: as asked, uncapped
            assert claim is None and lease.expires_at < granted
            await w.release(held.id)
            await w.release((await waiting).id)
            await settle(w)

    run(main())


def test_a_preemption_never_stops_a_shared_service_and_stops_an_own_unit_despite_failures() -> None:
    fw = world(preempt_grace="20ms")
    for unit in ("cron.service", "train.service"):
        fw.systemd.add_unit(FakeUnit(unit))
    fw.systemd.fail_stops["train.service"] = 2  # its stop job fails twice, then works

    async def main() -> None:
        async with running(fw.window()) as w:
            # A lease bound to cron.service, as a gpuswapd before the binding rule recorded a cron
            # job's: a member's request at priority 0 must not get cron stopped for everyone.
            await w.acquire("cron.service", 60, unit="cron.service", uid=1000, priority=-5)
            await w.acquire("train.service", 60, unit="train.service", uid=1000, priority=-5)
            urgent = await w.acquire("urgent", 60, profile="bare", priority=0)
            assert w.last is not None and w.last.preempted is not None
            assert w.last.preempted.stopped_units == ("train.service",)
            await until(lambda: fw.systemd.units["train.service"].active_state == "inactive")
            await until(lambda: w.last is not None and w.last.preempted is not None
                        and w.last.preempted.stops_pending == ())
            assert fw.systemd.units["cron.service"].active_state == "active"
            assert fw.systemd.fail_stops["train.service"] == 0  # it took three stops
            await w.release(urgent.id)
            await settle(w)
            assert resident_back(fw)
            assert fw.systemd.units["cron.service"].active_state == "active"

    run(main())


def test_a_stop_a_restart_interrupted_is_redone_at_recovery() -> None:
    fw = world()
    fw.systemd.add_unit(FakeUnit("train.service"))

    async def main() -> None:
        async with running(fw.window()) as w:
            lease = await w.acquire("train.service", 60, unit="train.service")
            rec = w.record
            assert rec is not None
            # Revoked, its stop not confirmed yet, and then gpuswapd is killed.
            rec.leases.release(lease.id)
            rec.preempted = Preemption(by="urgent", profile="bare", priority=5, at=clock.wall(), grace_s=0,
                                       deadline=clock.wall(), revoked_at=clock.wall(),
                                       stopped_units=("train.service",), stops_pending=("train.service",))
            await w.persist(required=True)
            w.stopping.set()
        document = fw.store.document
        assert document is not None and document.window is not None
        async with running(fw.window(), document.seq) as w2:
            w2.recover(document.window)
            await until(lambda: fw.systemd.units["train.service"].active_state == "inactive")
            await settle(w2)
        assert resident_back(fw)

    run(main())
