"""Talk to gpuswapd over its socket: one JSON request, events, one reply."""

from __future__ import annotations

import contextlib
import getpass
import grp
import json
import os
import socket
import stat
from collections.abc import Callable, Iterator
from typing import Any

from gpuswapd.errors import GpuswapError
from gpuswapd.instances import DEFAULT_INSTANCE, valid_name
from gpuswapd.instances import socket_of as instance_socket

DEFAULT_SOCKET = "/run/gpuswapd/gpuswapd.sock"
REPLY_TIMEOUT_S = 120.0


class Unreachable(Exception):
    """gpuswapd's socket cannot be reached."""


class BadInstance(ValueError):
    """$GPUSWAPD_INSTANCE names no instance gpuswapd could run as."""


def socket_path(explicit: str | None, instance: str | None = None) -> str:
    """Pick the socket: --socket, --instance, $GPUSWAPD_SOCKET, $GPUSWAPD_INSTANCE, then the default's."""
    if explicit:
        return explicit
    if instance:
        return instance_socket(instance)
    if os.environ.get("GPUSWAPD_SOCKET"):
        return os.environ["GPUSWAPD_SOCKET"]
    named = os.environ.get("GPUSWAPD_INSTANCE")
    if named:
        if named != DEFAULT_INSTANCE and not valid_name(named):
            raise BadInstance(f"$GPUSWAPD_INSTANCE={named!r} is not an instance name "
                              "(lowercase letters, digits, '_' and '-', such as 0 for gpuswapd@0)")
        return instance_socket(named)
    return instance_socket(DEFAULT_INSTANCE)


def _who_may_connect(path: str) -> str:
    """Say who may connect to the socket, from the socket file itself (its group may be any)."""
    try:
        st = os.stat(path)
        group = grp.getgrgid(st.st_gid).gr_name
    except (OSError, KeyError):
        return "ask the administrator which group may use gpuswapd"
    return (f"only root and members of group {group!r} may connect (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"an administrator can add you: usermod -aG {group} {getpass.getuser()}")


def _how_to_listen(path: str) -> str:
    """Say which socket unit listens on ``path`` and how to start it (socket activation starts gpuswapd)."""
    name = os.path.basename(path).removesuffix(".sock")
    if path == instance_socket(DEFAULT_INSTANCE):
        unit = "gpuswapd.socket"
    elif valid_name(name) and path == instance_socket(name):
        unit = f"gpuswapd@{name}.socket"
    else:
        return f"is gpuswapd running with daemon.socket = {path!r}? (systemctl status gpuswapd)"
    return f"gpuswapd's socket is not listening; start it, and gpuswapd with it: systemctl enable --now {unit}"


class Client:
    """One connection to gpuswapd."""

    def __init__(self, path: str, connect_timeout: float = 5.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(path)
        except FileNotFoundError:
            self._sock.close()
            raise Unreachable(f"{path} does not exist: {_how_to_listen(path)}") from None
        except PermissionError:
            self._sock.close()
            raise Unreachable(f"permission denied on {path}: {_who_may_connect(path)}") from None
        except OSError as err:
            self._sock.close()
            raise Unreachable(f"cannot connect to {path}: {err.strerror or err}") from None
        self._sock.settimeout(None)
        self._file = self._sock.makefile("rb")

    def fileno(self) -> int:
        """Return the socket's file descriptor (for select)."""
        return self._sock.fileno()

    def request(self, message: dict[str, Any], on_event: Callable[[dict[str, Any]], None] | None = None,
                timeout: float | None = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """Send one request; pass events to ``on_event``; return the reply or raise its error.

        ``timeout`` bounds each wait for a line (None: wait as long as the daemon works, as an
        acquire does while the window opens).
        """
        self._sock.settimeout(timeout)
        try:
            # gpuswapd may have refused the connection at once (too many clients): its line says why.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._sock.sendall(json.dumps(message).encode() + b"\n")
            return self._reply(on_event)
        except TimeoutError:
            raise Unreachable(f"gpuswapd did not answer on {self.path} within {timeout:g}s") from None
        except OSError as err:
            raise Unreachable(f"lost the connection to gpuswapd on {self.path}: {err.strerror or err}") from None

    def watch(self) -> Iterator[dict[str, Any]]:
        """Subscribe to gpuswapd's events and yield them as they come, ``{"event": "subscribed"}`` first."""
        self._sock.settimeout(None)
        try:
            self._sock.sendall(json.dumps({"op": "watch"}).encode() + b"\n")
            while line := self._file.readline():
                data = json.loads(line)
                if "event" not in data:  # a refusal (not allowed, too many connections)
                    raise GpuswapError.from_dict(data.get("error") or {"message": "no reason given"})
                yield data
        except OSError as err:
            raise Unreachable(f"lost the connection to gpuswapd on {self.path}: {err.strerror or err}") from None
        raise Unreachable(f"gpuswapd closed the connection on {self.path} (it stopped, or this watcher fell "
                          "behind and was dropped)")

    def listen(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        """Pass the events that come after a reply to ``on_event`` until the connection ends."""
        try:
            while line := self._file.readline():
                data = json.loads(line)
                if "event" in data:
                    on_event(data)
        except (OSError, ValueError):
            return  # closed under it (the lease ended here), or gpuswapd went away

    def _reply(self, on_event: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        waited = False
        while True:
            line = self._file.readline()
            if not line:
                if waited:
                    raise Unreachable(f"gpuswapd closed the connection on {self.path} while this request waited "
                                      "(it stopped, restarted or was killed): waiting requests are not kept across "
                                      "a restart; acquire again once it is back (systemctl status gpuswapd)")
                raise Unreachable(f"gpuswapd closed the connection on {self.path} without a reply")
            data = json.loads(line)
            if "event" in data:
                waited = True
                if on_event is not None:
                    on_event(data)
                continue
            if not data.get("ok"):
                raise GpuswapError.from_dict(data.get("error") or {"message": "no reason given"})
            reply: dict[str, Any] = data
            return reply

    def close(self) -> None:
        """Close the connection (waking a thread that still reads from it first)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._file.close()
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
