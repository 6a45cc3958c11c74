"""gpuswapd: hand one GPU from a resident model to a bigger engine and back, safely."""

__version__ = "0.1.0"
