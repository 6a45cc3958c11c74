"""A deterministic simulation of gpuswapd: the real daemon on simulated systems, under virtual time.

The real ``Daemon`` (its ``Window``, ``recover_at_start``, the queue and the socket server's
request handling) runs on one event loop whose clock is virtual: a wait of an hour costs nothing,
and nothing depends on how fast this machine is. The outside systems (systemd, Docker, the card,
the model servers, the state directory, the clients) are simulated in ``world``; a seed draws a
configuration and a history of events (``history``), ``runner`` plays it, and ``checks`` holds
the invariants, checked all along and once everything is quiet. A SIGKILL abandons the daemon's
loop with all its tasks (no ``finally`` runs, as with a real SIGKILL) and starts a new daemon on
what was persisted, on the same clock.
"""
