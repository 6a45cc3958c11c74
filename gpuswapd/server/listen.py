"""The listening socket: handed over by systemd (LISTEN_FDS), or made here with group and mode."""

from __future__ import annotations

import contextlib
import grp
import os
import resource
import socket
import stat
from pathlib import Path

from gpuswapd.errors import ConfigError

SD_LISTEN_FDS_START = 3
FD_HEADROOM = 256  # beyond the clients: state, D-Bus, Docker, HTTP, nvidia-smi, the engine watcher


def activation_socket() -> socket.socket | None:
    """Take the socket systemd passed (socket activation), if it passed one to this process."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)  # not for our children
    if count < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ConfigError(
            "the socket systemd passed is not a Unix stream socket: check ListenStream= in gpuswapd.socket"
        )
    sock.setblocking(False)
    for extra in range(SD_LISTEN_FDS_START + 1, SD_LISTEN_FDS_START + count):
        with contextlib.suppress(OSError):
            os.close(extra)
    return sock


def own_socket(path: str, group: str, mode: int = 0o660) -> socket.socket:
    """Create, bind and listen on the socket at ``path`` with ``group`` and ``mode``."""
    p = Path(path)
    p.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    gid = -1
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(
                f"daemon.socket_group: no group {group!r} (create it with "
                f"`systemd-sysusers` or `groupadd --system {group}`)"
            ) from None
    _remove_stale(p)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # no moment at which others could connect
    try:
        sock.bind(str(p))
    except OSError as err:
        sock.close()
        raise ConfigError(f"daemon.socket: cannot bind {p}: {err.strerror}") from None
    finally:
        os.umask(old)
    try:
        os.chown(p, -1, gid)
        os.chmod(p, mode)
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"daemon.socket: cannot give {p} group {group!r} and mode {mode:o}: {err.strerror} "
            "(without CAP_CHOWN, let systemd create the socket: enable gpuswapd.socket)"
        ) from None
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _remove_stale(path: Path) -> None:
    """Remove a socket file left by a daemon that died; refuse if one still answers there."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"daemon.socket: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1)
        probe.connect(str(path))
    except OSError:
        path.unlink()
    else:
        raise ConfigError(f"daemon.socket: another gpuswapd already listens on {path}")
    finally:
        probe.close()


def raise_fd_limit(max_clients: int) -> int:
    """Make room for ``max_clients`` connections and the daemon's own descriptors; return the limit."""
    need = max_clients + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    target = need if hard == resource.RLIM_INFINITY else min(hard, need)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        raise ConfigError(
            f"daemon.max_clients: {max_clients} connections need {need} file descriptors, but the limit is "
            f"{soft}: raise LimitNOFILE= in gpuswapd.service or lower daemon.max_clients"
        )
    return soft
