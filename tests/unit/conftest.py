"""The fast layer: no root, no test world; gpuswapd's own log is kept to warnings and errors."""

from __future__ import annotations

import os
from pathlib import Path

from gpuswapd.logs import setup_logging

# Thousands of windows run here on fakes: their info lines cost more than the checks themselves.
setup_logging("warning", json=False, cache=False)


# The known-bad table of this checkout, and no operator's rows: never the installed machine's
# /usr/share/gpuswapd/known-bad.toml or /etc/gpuswapd/known-bad.d (a package's check() runs here too).
os.environ.setdefault("GPUSWAPD_KNOWN_BAD",
                      str(Path(__file__).resolve().parents[2] / "gpuswapd" / "data" / "known-bad.toml"))
os.environ.setdefault("GPUSWAPD_KNOWN_BAD_DIR", str(Path(__file__).resolve().parent / "no-known-bad.d"))  # absent
