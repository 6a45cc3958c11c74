"""What an engine's container runs with: its image, environment, command line, user and mounts.

Read from the configuration (``[window.container]`` and its env file) where nothing else is known
(``--check-config``), and from Docker where it answers: the image's own ENV, ENTRYPOINT, CMD and
USER under the configured ones, or, for ``create = false``, the existing container itself. The
compile-cache check and the known-bad table look at this view, never at the raw configuration.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuswapd.adapters.docker import RunSettings
    from gpuswapd.config import ContainerConfig

_ROOT_USERS = ("", "root", "0")
_KEPT_KINDS = ("bind", "volume")  # a tmpfs, say, is gone when the container stops


@dataclass(frozen=True)
class Mount:
    """A path of the container that lies outside its own filesystem."""

    target: str
    source: str
    writable: bool
    persistent: bool  # outlives the container: a bind mount or a volume

    def holds(self, path: str) -> bool:
        """Tell whether ``path`` lies in this mount."""
        target = self.target.rstrip("/") or "/"
        return path == target or path.startswith(target if target == "/" else target + "/")


@dataclass(frozen=True)
class EngineView:
    """The settings an engine's container runs with."""

    image: str
    env: dict[str, str]
    argv: list[str]
    mounts: tuple[Mount, ...] = ()
    user: str = ""  # "" is root, as in Docker
    create: bool = True  # False: an existing container, whose own filesystem stays between windows
    origin: str = "the configuration"

    @property
    def root(self) -> bool:
        """Tell whether the engine runs as root."""
        return self.user.partition(":")[0] in _ROOT_USERS

    def home(self) -> str | None:
        """Return the engine user's home ($HOME, or /root for root); None when it cannot be known."""
        if self.env.get("HOME"):
            return self.env["HOME"]
        return "/root" if self.root else None

    def user_name(self) -> str:
        """Return the engine user's name as Python's getpass would find it."""
        for key in ("LOGNAME", "USER", "LNAME", "USERNAME"):
            if self.env.get(key):
                return self.env[key]
        return "root" if self.root else self.user.partition(":")[0]

    def expand(self, path: str) -> str | None:
        """Make ``path`` absolute, a leading ``~`` the user's home; None when that cannot be known."""
        if path == "~" or path.startswith("~/"):
            home = self.home()
            if home is None:
                return None
            path = posixpath.join(home, path[2:])
        return posixpath.normpath(path) if path.startswith("/") else None  # relative: to an unknown cwd

    def mount_of(self, path: str) -> Mount | None:
        """Return the mount ``path`` lies in (the innermost), or None: the container's own filesystem."""
        holding = [m for m in self.mounts if m.holds(path)]
        return max(holding, key=lambda m: len(m.target), default=None)


def from_config(c: ContainerConfig, file_env: dict[str, str]) -> EngineView:
    """Describe the container as the configuration makes it (``file_env``: its env file, as read).

    An existing container (``create = false``) is started as it is: its environment, command and
    mounts are Docker's to tell (``from_container``), and only its image is known here.
    """
    if not c.create:
        return EngineView(image=c.image, env={}, argv=[], create=False,
                          origin="the configuration (the existing container's own settings are Docker's to tell)")
    mounts = []
    for source, spec in c.volumes.items():
        target, _, options = spec.partition(":")
        mounts.append(Mount(posixpath.normpath(target), source, "ro" not in options.split(","), True))
    return EngineView(image=c.image, env={**file_env, **c.env}, argv=list(c.command), mounts=tuple(mounts),
                      create=c.create)


def under_image(view: EngineView, image: RunSettings) -> EngineView:
    """Add what the image brings: its ENV under the configured one, its ENTRYPOINT and CMD, its USER."""
    return replace(view, env={**image.env, **view.env}, argv=[*image.entrypoint, *(view.argv or image.cmd)],
                   user=image.user, origin="the configuration and the image")


def from_container(view: EngineView, c: RunSettings) -> EngineView:
    """Describe an existing container (``create = false``) as Docker says it runs."""
    mounts = tuple(Mount(posixpath.normpath(m.target), m.source, m.writable, m.kind in _KEPT_KINDS)
                   for m in c.mounts)
    return replace(view, image=c.image or view.image, env=dict(c.env), argv=[*c.entrypoint, *c.cmd], mounts=mounts,
                   user=c.user, origin="the existing container")
