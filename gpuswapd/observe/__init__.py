"""Watching the window.

Metrics and their scrape server, hooks, the textfile, and ``observers``, which ties them to the
window's events.
"""

from gpuswapd.observe.observers import Observers

__all__ = ["Observers"]
