"""The GPU window: its face for clients and its driver (``Window``), the steps it goes through.

Floors, top down: ``window`` (the Window: acquire, renew, release, status, and the driver that
supervises the record); the steps it runs (``recovery``, ``holding``, ``opening``, ``closing``,
``preempting``, ``parking``, ``identity``, ``prefetch``, ``progress``), which see only a
``Context``; ``context`` (what a step may touch), ``queueing``, ``baseline`` and ``plan``.
"""

from gpuswapd.window.context import Backoffs, Context
from gpuswapd.window.window import Window

__all__ = ["Backoffs", "Context", "Window"]
