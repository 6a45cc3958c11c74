"""The test world's stand-ins: the simulated GPU (a VRAM ledger and a fake ``nvidia-smi``), the
vLLM-like engine, llama-swap and the agent jobs (standard library only).

Every module here is also a script (``python3 FILE.py ...``) that runs with Debian's
``/usr/bin/python3`` and nothing else: inside the test world's PID/mount namespace and inside
a Docker container that only sees the host's ``/usr``. Their own tests are in ``tests/standins``;
the deterministic simulation of the whole daemon (virtual time, no processes) is
``tests/simulation``, which is something else.
"""
