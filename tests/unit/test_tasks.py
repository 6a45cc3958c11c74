"""Running awaitables together: the first failure cancels the rest, and the caller is left as it was."""

from __future__ import annotations

import asyncio

import pytest

from gpuswapd.tasks import together


def test_together_returns_every_result_in_order() -> None:
    async def value(x: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return x

    assert asyncio.run(together(value(1, 0.02), value(2, 0.0))) == [1, 2]


def test_the_first_failure_cancels_the_rest_and_leaves_the_caller_uncancelled() -> None:
    """Python 3.11's TaskGroup left its parent cancelling() here (seed 7342425: an abandoned opening
    read as the window driver's own cancellation)."""
    cancelled: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append("slow")
            raise

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("boom")

    async def caller() -> int:
        with pytest.raises(ValueError, match="boom"):
            await together(slow(), fails())
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    assert asyncio.run(caller()) == 0
    assert cancelled == ["slow"]


def test_a_cancelled_caller_takes_its_children_with_it() -> None:
    ended: list[str] = []

    async def child() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            ended.append("child")

    async def main() -> None:
        task = asyncio.ensure_future(together(child(), child()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ended == ["child", "child"]
