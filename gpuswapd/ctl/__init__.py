"""gpuswapctl: the command-line client of gpuswapd."""
