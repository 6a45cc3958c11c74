"""The GPU window: its face for clients, its driver, and the steps it goes through.

Floors, top down: ``window`` (the Window: acquire, renew, release, status for the clients, and
the window's state); ``driver`` (the one task that takes the record through its phases); the
steps it runs (``recovery``, ``holding``, ``preempting``, ``opening``, ``closing``,
``identity``, ``plan``, ``parking``, ``prefetch``, ``progress``), which see only a
``Context``; ``context`` (what a step may touch); ``queueing`` and ``baseline``; ``price`` (a
swap's price, from history). The import contracts in pyproject.toml keep each floor from
importing those above it.
"""

from gpuswapd.window.context import Backoffs, Context
from gpuswapd.window.window import Window

__all__ = ["Backoffs", "Context", "Window"]
