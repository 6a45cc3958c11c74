"""The engine's compile caches: kept on a volume, or compiled again at every boot.

vLLM compiles kernels on its first boot (torch.compile with Inductor, Triton, FlashInfer's JIT)
and keeps them in these caches. A container that gpuswapd creates is removed when its window
closes, so a cache that is not on a volume goes with it and the next boot compiles again: on the
reference machine (HyperQwen on an RTX 3090) about 3 minutes to healthy with the first compile,
about 1 minute from a filled cache. An existing container (``create = false``) keeps its own
filesystem between windows, and is not checked.

    VLLM_CACHE_ROOT            ${XDG_CACHE_HOME:-~/.cache}/vllm; vLLM also keeps Inductor's cache there
    TORCHINDUCTOR_CACHE_DIR    ${TMPDIR:-/tmp}/torchinductor_USER
    TRITON_CACHE_DIR           ${TRITON_HOME:-~}/.triton/cache
    FLASHINFER_WORKSPACE_BASE  FlashInfer's JIT cache is ${FLASHINFER_WORKSPACE_BASE:-~}/.cache/flashinfer
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from gpuswapd.parts.engineview import EngineView, Mount

FIRST_COMPILE = "about 3 minutes to healthy with the first compile against about 1 minute from a filled cache"


@dataclass(frozen=True)
class Cache:
    """One compile cache: where it lies in the container, and the mount that keeps it, if any."""

    name: str
    variable: str  # the variable that places it
    path: str | None  # None: it lies in the home of a user whose home is not known
    mount: Mount | None  # the mount it lies in; None: the container's own filesystem
    inside: str | None = None  # kept because it lies in another, kept cache (Inductor's in vLLM's)

    @property
    def on_volume(self) -> bool:
        """Tell whether its own mount keeps it: writable and outliving the container."""
        return self.mount is not None and self.mount.writable and self.mount.persistent

    @property
    def kept(self) -> bool:
        """Tell whether it outlives the container."""
        return self.on_volume or self.inside is not None

    def named(self) -> str:
        """Name it with its variable and its path, for a message."""
        return f"{self.variable} ({self.path or 'under the home of the container user, not known here'})"

    def to_dict(self) -> dict[str, Any]:
        """Describe it for ``plan``."""
        return {"cache": self.name, "variable": self.variable, "path": self.path, "kept": self.kept,
                "mount": None if self.mount is None else {"target": self.mount.target, "source": self.mount.source,
                                                          "writable": self.mount.writable},
                "inside": self.inside}


def compile_caches(view: EngineView) -> list[Cache]:
    """Find the engine's compile caches in its container and what keeps each."""
    env, home = view.env, view.home()

    def place(variable: str, default: str | None) -> str | None:
        return view.expand(env[variable]) if env.get(variable) else default

    def under(base: str | None, *parts: str) -> str | None:
        return None if base is None else posixpath.join(base, *parts)

    cache_home = place("XDG_CACHE_HOME", under(home, ".cache"))
    tmp = place("TMPDIR", "/tmp") or "/tmp"
    paths = [
        ("vLLM's compile cache", "VLLM_CACHE_ROOT", place("VLLM_CACHE_ROOT", under(cache_home, "vllm"))),
        ("Inductor's cache", "TORCHINDUCTOR_CACHE_DIR",
         place("TORCHINDUCTOR_CACHE_DIR", posixpath.join(tmp, f"torchinductor_{view.user_name()}"))),
        ("Triton's cache", "TRITON_CACHE_DIR",
         place("TRITON_CACHE_DIR", under(place("TRITON_HOME", home), ".triton", "cache"))),
        ("FlashInfer's JIT cache", "FLASHINFER_WORKSPACE_BASE",
         under(place("FLASHINFER_WORKSPACE_BASE", home), ".cache", "flashinfer")),
    ]
    caches = [Cache(name, variable, path, None if path is None else view.mount_of(path))
              for name, variable, path in paths]
    vllm, inductor = caches[0], caches[1]
    if vllm.on_volume and not inductor.on_volume:
        # vLLM points Inductor at a directory of its own cache when it compiles (TORCHINDUCTOR_CACHE_DIR
        # is set, unconditionally, under VLLM_CACHE_ROOT/torch_compile_cache).
        caches[1] = Cache(inductor.name, inductor.variable, inductor.path, inductor.mount, inside=vllm.variable)
    return caches


def warning(where: str, view: EngineView, caches: list[Cache]) -> str | None:
    """Say what a container that keeps none of its compile caches costs, and what to mount; None if it keeps one."""
    if not view.create or any(c.kept for c in caches):
        return None
    lost = ", ".join(c.named() + (" (mounted read-only)" if c.mount is not None and not c.mount.writable else "")
                     for c in caches)
    return (f"{where}.container keeps no compile cache on a volume: {lost} all lie in the container, which is "
            f"removed when the window closes, so every boot compiles the engine's kernels again ({FIRST_COMPILE}, "
            f"as measured on an RTX 3090). Mount a volume for them, e.g. {where}.container.volumes = "
            f"{{ \"/var/cache/gpuswapd/{_slug(view.image)}\" = \"/cache\" }} with {where}.container.env "
            "VLLM_CACHE_ROOT = \"/cache/vllm\", TRITON_CACHE_DIR = \"/cache/triton\" and "
            "FLASHINFER_WORKSPACE_BASE = \"/cache\"")


def _slug(image: str) -> str:
    name = image.rpartition("/")[2].partition(":")[0].partition("@")[0]
    return name or "engine"
