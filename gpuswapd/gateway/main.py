"""``gpuswapd-gateway``: configuration, the listening socket (systemd's, or its own), and uvicorn.

    gpuswapd-gateway [--config PATH] [--socket PATH] [--check-config] [--log-level LEVEL]

It reads gpuswapd's own configuration file (``[gateway]`` and the profiles' ``serves``) and
reaches gpuswapd at ``daemon.socket`` or ``--socket``. Under socket activation
(``gpuswapd-gateway.socket``) it serves the TCP socket systemd hands it, and ``gateway.listen`` is
ignored. A configuration error exits 78, as gpuswapd's does.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import socket
import sys
from pathlib import Path

import uvicorn

from gpuswapd import __version__
from gpuswapd.config import DEFAULT_PATH, Config, gateway_problems, load_config
from gpuswapd.errors import ConfigError
from gpuswapd.gateway import guard
from gpuswapd.gateway.app import DROPPED, Gateway
from gpuswapd.gateway.demand import Demand
from gpuswapd.gateway.follow import Follow
from gpuswapd.gateway.guard import MAX_CONNECTIONS, MAX_PENDING
from gpuswapd.gateway.link import Link
from gpuswapd.gateway.meters import Meters
from gpuswapd.gateway.tenants import Tenants
from gpuswapd.gateway.upstream import Upstream
from gpuswapd.logs import log, setup_logging

EX_CONFIG = 78
SD_LISTEN_FDS_START = 3
UNIT_PREFIX = "gpuswapd-gateway"
KEEP_ALIVE_S = 75  # an idle keep-alive connection is closed after this (longer than common clients' pools)
SHUTDOWN_S = 30  # requests in flight get this long to finish when the gateway stops


def build(config: Config, socket_path: str | None = None, holder: str | None = None) -> Gateway:
    """Put the gateway together for ``config`` (gpuswapd at ``socket_path``, else ``daemon.socket``)."""
    link = Link(socket_path or config.daemon.socket)
    follow = Follow(link)
    meters = Meters()
    demand = Demand(config.gateway, link, follow, meters, holder=holder if holder is not None else _holder())
    return Gateway(config, demand, follow, Tenants.from_environment(config), Upstream(), meters)


def _dropped_on_purpose(record: logging.LogRecord) -> bool:
    """Keep out of the log the connections the gateway drops on purpose (the app logged why already)."""
    return not (record.exc_info and isinstance(record.exc_info[1], DROPPED))


def _more_files(wanted: int) -> None:
    """Raise the soft limit of open files toward ``wanted`` (at most the hard limit), as a server should."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    goal = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < goal:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (goal, hard))


def _holder() -> str | None:
    """Name the lease holder: None under the gateway's own unit (gpuswapd names the unit), else a name."""
    if os.environ.get("INVOCATION_ID") and (unit := _own_unit()) and unit.startswith(UNIT_PREFIX):
        return None
    return f"gpuswapd-gateway[{os.getpid()}]"


def _own_unit() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            last = line.rpartition("/")[2]
            if last.endswith(".service"):
                return last
    return None


def listening_socket(config: Config) -> tuple[socket.socket, str]:
    """Take the socket systemd passed, or bind ``gateway.listen``; say which."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and os.environ.get("LISTEN_FDS", "0") not in ("", "0"):
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise ConfigError("the socket systemd passed is not a TCP stream socket: check ListenStream= in "
                              "gpuswapd-gateway.socket")
        return sock, "systemd"
    host, _, port = config.gateway.listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as err:
        sock.close()
        raise ConfigError(f"gateway.listen: cannot listen on {config.gateway.listen}: {err.strerror}") from None
    sock.listen(1024)
    return sock, config.gateway.listen


def main(argv: list[str] | None = None) -> int:
    """Run the gateway (``gpuswapd-gateway --config PATH``)."""
    parser = argparse.ArgumentParser(prog="gpuswapd-gateway",
                                     description="One OpenAI-compatible address for every model on the card.")
    parser.add_argument("--config", default=str(DEFAULT_PATH),
                        help=f"gpuswapd's configuration (default {DEFAULT_PATH})")
    parser.add_argument("--socket", help="gpuswapd's socket (default: daemon.socket of the configuration)")
    parser.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--version", action="version", version=f"gpuswapd-gateway {__version__}")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        for line in err.message.splitlines():  # every error found, one a line
            print(f"gpuswapd-gateway: {line}", file=sys.stderr)
        return EX_CONFIG
    if args.check_config:
        problems = gateway_problems(config)
        for problem in problems:
            print(f"gpuswapd-gateway: {args.config}: {problem}", file=sys.stderr)
        if problems:
            return EX_CONFIG
        print(f"{args.config}: ok")
        return 0
    try:
        sock, where = listening_socket(config)
    except ConfigError as err:
        print(f"gpuswapd-gateway: {err.message}", file=sys.stderr)
        return EX_CONFIG
    app = build(config, args.socket)
    logging.getLogger("uvicorn.error").addFilter(_dropped_on_purpose)
    _more_files(MAX_CONNECTIONS + MAX_PENDING + 2048 + 256)  # clients, heads coming, upstream, the rest
    server = uvicorn.Server(uvicorn.Config(
        app, lifespan="on", log_config=None, log_level=args.log_level, access_log=False, server_header=False,
        date_header=False, limit_concurrency=None, timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=SHUTDOWN_S, loop="auto", http=guard.protocol(app.meters.cut)))
    log.info("gateway_starting", version=__version__, listen=where, gpuswapd=args.socket or config.daemon.socket,
             resident=config.gateway.resident,
             serves={t.name: [n for n, x in app.tenants.served() if x is t] for t in app.tenants.engines.values()})
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":  # python -m gpuswapd.gateway.main: an interpreter without the console script
    sys.exit(main())
