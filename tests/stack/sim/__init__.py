"""Simulated GPU, engine and proxy for the gpuswapd test world (standard library only).

Every module here is also a script (``python3 FILE.py ...``) that runs with Debian's
``/usr/bin/python3`` and nothing else: inside the test world's PID/mount namespace and inside
a Docker container that only sees the host's ``/usr``.
"""
