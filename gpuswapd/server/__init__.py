"""The socket side.

gpuswapd's Unix socket (``server``), who is asking (``peers``), what they may do (``admission``),
the sockets systemd hands over (``listen``), the connections being served (``clients``, the
``/metrics`` server's too) and the event watchers (``watch``).
"""

from gpuswapd.server.server import Server

__all__ = ["Server"]
