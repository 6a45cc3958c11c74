"""Where blocking calls run: a few daemon threads per outside system, or the simulation's loop.

In service a blocking call (pydbus, the Docker SDK, NVML, a file write) runs on a daemon thread,
so a hung one never keeps gpuswapd from exiting, and hands its outcome back to the event loop.
The deterministic simulation swaps the pools for one that runs each call on the event loop
itself (``use``): its fakes answer at once, or with an awaitable for a call that would block,
and a hang is an answer that comes late in virtual time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

# Called with the call's result, or with the exception it raised (then the result is None).
Done = Callable[[Any, BaseException | None], None]


class Pool(Protocol):
    """Runs blocking calls somewhere other than the event loop's own turn."""

    def submit(self, work: Callable[[], Any], done: Done, late: float = 0.0) -> None:
        """Run ``work`` (``late`` seconds from now: a fault test's hang), then hand its outcome to ``done``."""

    def close(self) -> None:
        """Let the idle workers end."""


def _outcome(work: Callable[[], Any], done: Done, late: float) -> None:
    if late > 0:
        time.sleep(late)  # a fault test's stuck call: its thread returns long after the deadline
    try:
        result, error = work(), None
    except BaseException as err:  # handed to the awaiting side
        result, error = None, err
    done(result, error)


class Threads:
    """A few daemon threads: a hung call must never keep gpuswapd from exiting.

    A worker that has had nothing to do for a while ends; the next call starts one again.
    """

    IDLE_S = 30.0

    def __init__(self, name: str, count: int) -> None:
        self._name = name
        self._count = count
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], Any], done: Done, late: float = 0.0) -> None:
        """Run ``work`` on a worker thread, then call ``done`` there with its outcome."""
        with self._lock:
            self._jobs.put(lambda: _outcome(work, done, late))
            # Start a worker when the idle ones cannot take every queued job.
            if self._jobs.qsize() <= self._idle or self._threads >= self._count:
                return
            self._threads += 1
        threading.Thread(target=self._work, name=f"{self._name}-worker", daemon=True).start()

    def close(self) -> None:
        """Let every worker end once it is done with what it runs."""
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if not self._jobs.empty():
                        continue  # a job came just now: it is this worker's
                    self._threads -= 1
                return
            with self._lock:
                self._idle -= 1
                if job is None:
                    self._threads -= 1
                    return
            job()


class OwnThread:
    """One daemon thread per call: for a long wait that must not hold a worker of a shared pool."""

    def __init__(self, name: str, count: int = 1) -> None:
        self._name = name

    def submit(self, work: Callable[[], Any], done: Done, late: float = 0.0) -> None:
        """Run ``work`` on a daemon thread of its own, then call ``done`` there."""
        threading.Thread(target=_outcome, args=(work, done, late), name=self._name, daemon=True).start()

    def close(self) -> None:
        """Nothing to close: each thread ends with its call."""


PoolFactory = Callable[[str, int], Pool]
_pools: PoolFactory = Threads
_own: PoolFactory = OwnThread


def pool(name: str, count: int) -> Pool:
    """Make the pool of ``count`` workers for the outside system ``name``."""
    return _pools(name, count)


def own_thread(name: str) -> Pool:
    """Make a runner that gives each call a thread of its own."""
    return _own(name, 1)


def use(factory: PoolFactory) -> None:
    """Run every blocking call through pools made by ``factory`` from now on (the simulation's loop)."""
    global _pools, _own
    _pools = _own = factory


def reset() -> None:
    """Run blocking calls on threads again."""
    global _pools, _own
    _pools, _own = Threads, OwnThread
