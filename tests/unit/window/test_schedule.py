"""The schedule on in-process fakes: each profile's price of a swap, the share it buys, reclaims after a restart.

A tenant on the card keeps it while nobody waits for another profile, and while the oldest
request for another profile has waited less than its share (``max(fair_after, min(residency_max,
residency_factor * price))``); a token gives a client its lease or its place back after a restart.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from gpuswapd import clock
from gpuswapd.leases import Lease, LeaseBook
from gpuswapd.phases import Phase
from gpuswapd.protocol import parse_request, token_hash
from gpuswapd.record import Finished
from gpuswapd.window.price import Times
from gpuswapd.window.queueing import Queue, Waiter
from tests.fakes import FakeWorld, running, settle
from tests.unit.conftest import run, until, world


def _window(profile: str, *phases: tuple[str, str, float], switched_to: str | None = None) -> Finished:
    """Make the history line of a window of ``profile`` whose phases took these seconds, in this order."""
    at, timings = 1000.0, []
    for phase, stage, took in phases:
        timings.append({"phase": phase, "stage": stage, "started_at": at, "took_s": took})
        at += took
    return Finished.from_dict({"id": "w", "profile": profile, "outcome": "closed", "opened_at": 1000.0,
                               "closed_at": at, "timings": timings, "switched_to": switched_to})


def _cold(profile: str, boot: float, close: float, restore: float) -> Finished:
    return _window(profile, ("DRAINING", "open", 1.0), ("BOOTING", "open", boot), ("WARMING", "open", 2.0),
                   ("READY", "open", 60.0), ("CLOSING", "close", close), ("RESTORING", "close", restore),
                   ("RESUMING_TIMERS", "close", 0.0))


def test_the_price_of_a_swap_is_the_median_of_each_profiles_recent_windows() -> None:
    times = Times()
    for boot in (30.0, 40.0, 500.0):  # one slow boot does not move a median
        times.learn(_cold("default", boot, close=5.0, restore=10.0))
    times.learn(_window("default", ("DRAINING", "open", 1.0), ("WAKING", "open", 1.5), ("READY", "open", 9.0),
                        ("CLOSING", "close", 3.0), ("RESTORING", "close", 10.0)))
    price = times.price(["default", "eval"])
    assert price["default"]["boot_s"] == 40.0 and price["default"]["wake_s"] == 1.5
    assert price["default"]["resident_restart_s"] == 10.0 and price["default"]["close_s"] == 15.0
    assert price["default"]["open_s"] == 38.0 and price["default"]["windows"] == 4  # median of 33, 43, 503 and 2.5
    assert price["eval"] == {"open_s": None, "boot_s": None, "wake_s": None, "close_s": None,
                             "switch_close_s": None, "resident_restart_s": 10.0, "swap_s": None, "windows": 0}
    assert times.swap_price(None, "default") == 38.0  # from the resident: its open
    assert times.swap_price("default", "eval") == 15.0  # to a profile never seen: the close only


class _Priced(Times):
    def __init__(self, price: float) -> None:
        super().__init__()
        self.each = price

    def swap_price(self, leaving: str | None, coming: str) -> float:
        return self.each


def test_the_share_grows_with_the_price_between_fair_after_and_residency_max() -> None:
    assert Queue(60, factor=4, most=900, times=_Priced(5)).share("a", "b") == 60  # 4 * 10 s: fair_after's floor
    assert Queue(60, factor=4, most=900, times=_Priced(50)).share("a", "b") == 400  # 4 * the round trip
    assert Queue(60, factor=4, most=300, times=_Priced(500)).share("a", "b") == 300  # the ceiling
    assert Queue(600, factor=4, most=300, times=_Priced(500)).share("a", "b") == 600  # fair_after always holds


def test_the_tenant_keeps_the_card_until_the_oldest_other_request_has_waited_its_share() -> None:
    async def main() -> None:
        queue = Queue(10, factor=2, most=900, times=_Priced(15))  # share: 2 * 30 s = 60 s
        now = clock.wall()
        queue.waiters.append(Waiter("b", 60, None, None, "eval", since=now - 59))
        assert queue.blocked("default", now) is None  # new requests for the tenant still join
        claim = queue.fair_claim("default")
        assert claim is not None and math.isclose(claim[0], now + 1)
        assert queue.blocked("default", now + 1.5) is not None  # past its share: they queue behind it

    run(main())


def test_a_kept_queue_entry_is_reclaimed_once_by_its_token_within_the_grace() -> None:
    queue = Queue(10)
    kept = queue.keep([{"holder": "a", "profile": "eval", "since": 100.0, "token": "h1"},
                       {"holder": "old", "profile": "eval", "since": 50.0},  # an older gpuswapd's: no token
                       "junk"], now=200.0, grace=60)
    assert kept == 1
    assert queue.reclaim("h1", "default", 210.0) is None  # for another profile it is another request
    assert queue.keep([{"profile": "eval", "since": 100.0, "token": "h1"}], 200.0, 60) == 1
    assert queue.reclaim("h1", "eval", 261.0) is None  # past the grace
    queue.keep([{"profile": "eval", "since": 100.0, "token": "h1"}], 200.0, 60)
    assert queue.reclaim("h1", "eval", 210.0) == 100.0
    assert queue.reclaim("h1", "eval", 210.0) is None  # once


def test_a_lease_kept_for_reclaim_ends_at_its_grace_unless_reclaimed() -> None:
    book = LeaseBook([Lease("a", "run", 0.0, 1000.0, bound=True, token="h", reclaim_by=50.0),
                      Lease("b", "job", 0.0, 1000.0)])
    assert book.next_expiry() == 50.0
    assert [x.id for x in book.expire(50.0)] == ["a"]
    back = Lease.from_dict(Lease("c", "run", 0.0, 1000.0, bound=True, token="h", reclaim_by=5.0).to_dict())
    assert (back.token, back.reclaim_by, back.bound) == ("h", 5.0, True)


def test_a_reclaim_token_is_hex_and_anything_else_is_refused() -> None:
    req = parse_request(b'{"op": "acquire", "reclaim": "00112233445566778899aabbccddeeff"}')
    assert req.reclaim == "00112233445566778899aabbccddeeff"
    for bad in ('"XYZ"', "12", '"short"', '""'):
        try:
            parse_request(b'{"op": "acquire", "reclaim": ' + bad.encode() + b"}")
        except Exception as err:
            assert "reclaim" in str(err)
        else:
            raise AssertionError(f"{bad} was taken as a token")
    assert token_hash("ab") != "ab" and len(token_hash("ab")) == 64


def test_a_restart_keeps_a_bound_lease_with_a_token_for_its_client_to_reclaim() -> None:
    from gpuswapd.window.recovery import recover_at_start

    fw = FakeWorld()

    async def main() -> None:
        async with running(fw.window()) as w:
            held = await w.acquire("gpuswapctl-run", 600, bound=True, token=token_hash("aa" * 16))
            await w.acquire("gateway", 600, bound=True)  # without a token: it ends with gpuswapd, as before
            await w.shutdown(restore=False)
        again = fw.window()
        await recover_at_start(again)
        async with running(again):
            await until(lambda: again.phase is Phase.READY)
            assert [x.holder for x in again.leases()] == ["gpuswapctl-run"]
            assert again.leases()[0].reclaim_by is not None
            assert await again.reclaim(token_hash("bb" * 16), lambda _: True) is None
            back = await again.reclaim(token_hash("aa" * 16), lambda _: True)
            assert back is not None and back.id == held.id and back.reclaim_by is None
            await again.release(held.id)
            await settle(again)

    run(main())


def test_a_lease_nobody_reclaims_ends_at_the_grace_and_the_window_closes() -> None:
    from gpuswapd.window.recovery import recover_at_start

    fw = world(reclaim_grace="200ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            await w.acquire("gpuswapctl-run", 600, bound=True, token=token_hash("aa" * 16))
            await w.shutdown(restore=False)
        again = fw.window()
        await recover_at_start(again)
        async with running(again):
            await settle(again)  # its client never came back: the lease ended, the resident is back
            assert again.record is None

    run(main())


def test_requests_for_the_tenant_join_while_another_waits_within_its_share() -> None:
    fw = world(fair_after="300ms")

    async def main() -> None:
        async with running(fw.window()) as w:
            first = await w.acquire("agent-1", 60)
            other = asyncio.create_task(w.acquire("eval", 60, profile="eval"))
            await until(lambda: len(w.queue.queued()) == 1)
            second = await w.acquire("agent-2", 60)  # the tenant's: joins, no swap
            assert w.schedule(clock.wall())["swaps_avoided"] == 1
            assert w.schedule(clock.wall())["queue"] == {"eval": 1}
            rule = w.schedule(clock.wall())  # the rule the gateway's batching takes from status
            assert (rule["residency_factor"], rule["residency_max_s"]) == (6.0, 900.0)
            await asyncio.sleep(0.35)  # the eval request has waited its share
            third = asyncio.create_task(w.acquire("agent-3", 60))
            await until(lambda: len(w.queue.queued()) == 2)  # it queues behind eval now
            for lease in (first, second):
                await w.release(lease.id)
            got = await other
            assert w.record is not None and w.record.profile == "eval" and not third.done()
            await w.release(got.id)
            await w.release((await third).id)
            await settle(w)

    run(main())


def test_a_client_that_hangs_up_during_boot_leaves_it_running_for_a_retry_within_the_grace() -> None:
    fw = world(abandon_grace="300ms")
    booted = asyncio.Event()
    healthy = fw.http.wait_healthy

    async def slow(url: str, timeout: float, interval: float = 0.2, abort: Any = None) -> float:
        await booted.wait()  # the engine boots until the test says
        return await healthy(url, timeout, interval, abort)

    fw.http.wait_healthy = slow  # type: ignore[method-assign]

    async def main() -> None:
        async with running(fw.window()) as w:
            first = asyncio.create_task(w.acquire("impatient", 60))
            await until(lambda: w.phase is Phase.BOOTING)
            window = w.record.id if w.record is not None else None
            first.cancel()  # its timeout: it hangs up
            await asyncio.sleep(0.1)
            assert w.phase is Phase.BOOTING  # within the grace, the boot goes on
            retry = asyncio.create_task(w.acquire("impatient", 60))
            await asyncio.sleep(0.4)  # past the grace: the retry waits for it, so it is not abandoned
            booted.set()
            lease = await retry
            assert w.record is not None and w.record.id == window  # the same window, booted once
            await w.release(lease.id)
            await settle(w)
            booted.clear()
            gone = asyncio.create_task(w.acquire("impatient", 60))
            await until(lambda: w.phase is Phase.BOOTING)
            gone.cancel()
            await settle(w)  # nobody came back within the grace: rolled back
            assert w.last is not None and w.last.outcome == "rolled_back"

    run(main())
