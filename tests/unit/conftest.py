"""The fast layer: no root, no test world; gpuswapd's own log is kept to warnings and errors."""

from __future__ import annotations

from gpuswapd.logs import setup_logging

# Thousands of windows run here on fakes: their info lines cost more than the checks themselves.
setup_logging("warning", json=False, cache=False)
