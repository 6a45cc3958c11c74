"""Instances: one gpuswapd per GPU, as the systemd template ``gpuswapd@NAME.service``.

Each instance has its own configuration, socket, state and containers; only dockerd is shared::

    /etc/gpuswapd/instances/NAME.toml   its configuration (``--config`` may name another file)
    /run/gpuswapd/NAME.sock             its socket
    /var/lib/gpuswapd/NAME/             its state
    io.gpuswapd.instance=NAME           the label on its containers

The instance "default" is the plain ``gpuswapd.service`` (``/etc/gpuswapd/gpuswapd.toml``,
``/run/gpuswapd/gpuswapd.sock``, ``/var/lib/gpuswapd``). ``$GPUSWAPD_RUNTIME_DIR`` stands for
/run/gpuswapd and ``$GPUSWAPD_STATE_ROOT`` for /var/lib/gpuswapd (a test, or a second tree of
instances).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpuswapd.errors import ConfigError

if TYPE_CHECKING:
    from gpuswapd.config import Config

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli stays the fallback the package declares
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_INSTANCE = "default"
RUNTIME_DIR_ENV = "GPUSWAPD_RUNTIME_DIR"
STATE_ROOT_ENV = "GPUSWAPD_STATE_ROOT"
RUNTIME_DIR = "/run/gpuswapd"
STATE_ROOT = "/var/lib/gpuswapd"
CONFIG_DIR = "/etc/gpuswapd/instances"
DEFAULT_SOCKET_NAME = "gpuswapd.sock"
# Short enough that /run/gpuswapd/NAME.sock fits a Unix socket address (108 bytes).
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def valid_name(name: str) -> bool:
    """Tell whether ``name`` is an instance name (lowercase letters, digits, '_' and '-')."""
    return bool(_NAME.match(name))


def check_name(name: str) -> str:
    """Return ``name`` if gpuswapd may run as that instance; else a ConfigError that says why."""
    if name == DEFAULT_INSTANCE:
        raise ConfigError("--instance default: \"default\" is the plain gpuswapd.service; run gpuswapd without "
                          "--instance for it (systemctl start gpuswapd.socket)")
    if not valid_name(name):
        raise ConfigError(f"--instance {name!r}: an instance name is lowercase letters, digits, '_' and '-', "
                          "starting with a letter or digit (at most 64), such as the GPU's index: gpuswapd@0")
    if f"{name}.sock" == DEFAULT_SOCKET_NAME:
        raise ConfigError(f"--instance {name}: its socket would be the plain gpuswapd.service's "
                          f"({socket_of(DEFAULT_INSTANCE)}): choose another name")
    return name


def runtime_dir() -> Path:
    """Return the directory of the instances' sockets ($GPUSWAPD_RUNTIME_DIR, else /run/gpuswapd)."""
    return Path(os.environ.get(RUNTIME_DIR_ENV) or RUNTIME_DIR)


def state_root() -> Path:
    """Return the directory of the instances' state directories ($GPUSWAPD_STATE_ROOT, else /var/lib/gpuswapd)."""
    return Path(os.environ.get(STATE_ROOT_ENV) or STATE_ROOT)


def socket_of(name: str) -> str:
    """Return the socket of instance ``name`` ("default": the plain gpuswapd.service's)."""
    return str(runtime_dir() / (DEFAULT_SOCKET_NAME if name == DEFAULT_INSTANCE else f"{name}.sock"))


def state_dir_of(name: str) -> str:
    """Return the state directory of instance ``name`` ("default": the state root itself)."""
    return str(state_root() if name == DEFAULT_INSTANCE else state_root() / name)


def config_path(name: str) -> Path:
    """Return the configuration file of instance ``name``."""
    return Path(CONFIG_DIR) / f"{name}.toml"


def load_instance_config(path: str | os.PathLike[str], name: str) -> Config:
    """Read and validate instance ``name``'s configuration and give it the instance's socket and state.

    ``daemon.socket`` and ``daemon.state_dir`` may be left out or set to the instance's own paths;
    anything else is a ConfigError: two instances must never share a socket or a state.
    """
    # Imported here: gpuswapctl uses this module for names and paths only, and the configuration
    # brings in the daemon's logging (structlog), which a bare gpuswapctl does not need.
    from gpuswapd.config import parse_config

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no configuration for instance {name} (gpuswapd@{name} reads "
                          f"{config_path(name)})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    config = parse_config(text, str(path))
    daemon = tomllib.loads(text).get("daemon", {})
    own = {"socket": socket_of(name), "state_dir": state_dir_of(name)}
    for key, want in own.items():
        given = daemon.get(key)
        if given is not None and os.path.normpath(given) != want:
            raise ConfigError(f"{path}: daemon.{key}: {given!r} is not instance {name}'s {want}: an instance's "
                              f"socket and state follow from its name; leave daemon.{key} out")
    daemon_config = dataclasses.replace(config.daemon, socket=own["socket"], state_dir=own["state_dir"])
    return dataclasses.replace(config, daemon=daemon_config)


def warnings(config: Config, name: str) -> list[str]:
    """Say what is valid for an instance but probably not what was meant (``--check-config`` prints these)."""
    out = []
    if name.isdigit() and int(name) != config.gpu.index:
        out.append(f"instance {name} reads GPU {config.gpu.index} (gpu.index): gpuswapd@N is usually GPU N")
    for p in config.engine_profiles():
        where = "window" if p.name == "default" else f"profiles.{p.name}"
        if p.engine.container.gpus == "all":
            out.append(f"{where}.container.gpus = \"all\": the engine of instance {name} would get every GPU, "
                       f"also the other instances' cards; set gpus = [{config.gpu.index}]")
    return out


def find_instances() -> list[tuple[str, str]]:
    """List ``(instance, socket)`` for every gpuswapd socket in the runtime directory, "default" first."""
    found = []
    try:
        entries = sorted(runtime_dir().iterdir())
    except OSError:
        return []
    for path in entries:
        if path.suffix != ".sock":
            continue
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except OSError:
            continue
        name = DEFAULT_INSTANCE if path.name == DEFAULT_SOCKET_NAME else path.stem
        if name == DEFAULT_INSTANCE or valid_name(name):
            found.append((name, str(path)))
    return sorted(found, key=_order)


def _order(item: tuple[str, str]) -> tuple[int, int, str]:
    """Sort "default" first, then GPU numbers in order, then the other names."""
    name = item[0]
    if name == DEFAULT_INSTANCE:
        return (0, 0, name)
    return (1, int(name), name) if name.isdigit() else (2, 0, name)
