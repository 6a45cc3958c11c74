"""Benchmarks of gpuswapd on the test world (not part of the pytest suite): swap_bench, lease_bench."""
