"""The state writer: a cancelled caller wedges nothing, saves share writes, failures are retried."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from typing import Any

import pytest

from gpuswapd.errors import StateError
from gpuswapd.outside import Deadlines, Outside
from gpuswapd.record import Finished
from gpuswapd.state.store import Document
from gpuswapd.state.writer import StateWriter
from tests.fakes import FakeStore


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def _writer(store: FakeStore, state: dict[str, Any] | None = None) -> StateWriter:
    outside = Outside(Deadlines(state=2.0))
    return StateWriter(store, outside.state, lambda: Document(), backoff=(0.01, 0.05))  # type: ignore[arg-type]


class SlowStore(FakeStore):
    """A store whose writes wait on a gate and can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.writes = 0
        self.fail: OSError | None = None

    def write(self, data: bytes) -> None:
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.writes += 1
        super().write(data)


def test_a_caller_cancelled_while_its_save_is_in_flight_wedges_nothing() -> None:
    store = SlowStore()
    writer = _writer(store)

    async def main() -> None:
        writer.start()
        store.gate.clear()
        first = asyncio.create_task(writer.save())  # the write is in flight, held by the gate
        await asyncio.sleep(0.05)
        second = asyncio.create_task(writer.save())  # rides on the next write
        await asyncio.sleep(0.01)
        second.cancel()  # the client hung up
        first.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        store.gate.set()
        # Every later save still completes: nothing waits on a future nobody resolves.
        await asyncio.wait_for(writer.save(), 2)
        await asyncio.wait_for(writer.save(), 2)
        await writer.stop(1)

    run(main())
    assert store.writes >= 2


def test_saves_that_arrive_together_share_one_write() -> None:
    store = SlowStore()
    writer = _writer(store)

    async def main() -> None:
        writer.start()
        store.gate.clear()
        await asyncio.sleep(0.01)
        saves = [asyncio.create_task(writer.save()) for _ in range(50)]
        await asyncio.sleep(0.05)
        store.gate.set()
        await asyncio.gather(*saves)
        await writer.stop(1)

    run(main())
    assert 1 <= store.writes <= 3


def test_a_failed_write_is_reported_to_its_waiter_and_retried_until_it_lands() -> None:
    store = SlowStore()
    writer = _writer(store)
    changes: list[bool] = []
    writer.on_change = lambda: changes.append(writer.writable)

    async def main() -> None:
        writer.start()
        store.fail = OSError(errno.ENOSPC, "No space left on device")
        with pytest.raises(StateError, match="No space left on device"):
            await writer.save()
        assert not writer.writable and "keeps the window in memory" in (writer.error or "")
        store.fail = None  # the disk has room again: the writer retries on its own
        deadline = time.monotonic() + 2
        while not writer.writable:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await writer.stop(1)

    run(main())
    assert changes == [False, True] and store.writes >= 1


def test_history_lands_before_the_document_that_clears_the_window() -> None:
    store = SlowStore()
    writer = _writer(store)
    order: list[str] = []
    real_append = store.append_history
    store.append_history = lambda records: (order.append("history"), real_append(records))  # type: ignore
    real_write = store.write
    store.write = lambda data: (order.append("document"), real_write(data))  # type: ignore

    async def main() -> None:
        writer.start()
        await writer.wait(writer.add_history(Finished.from_dict({"id": "w1"})))
        await writer.stop(1)

    run(main())
    assert order == ["history", "document"] and store.history_records == [{"id": "w1"}]


def test_the_writer_is_restarted_if_it_fails_on_a_bug() -> None:
    store = SlowStore()
    calls = 0

    def snapshot() -> Document:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug while serializing")
        return Document()

    outside = Outside(Deadlines(state=2.0))
    writer = StateWriter(store, outside.state, snapshot, backoff=(0.01, 0.05))  # type: ignore[arg-type]

    async def main() -> None:
        writer.start()
        writer.request()
        await asyncio.sleep(0.05)
        await asyncio.wait_for(writer.save(), 2)
        await writer.stop(1)

    run(main())
    assert store.writes >= 1
