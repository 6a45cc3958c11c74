"""Before an engine boots: its compile caches and the known-bad table, for each engine profile.

``--check-config`` looks at what the configuration says; the start and ``gpuswapctl plan`` at
what Docker says the container runs with (``engineview``). A container that keeps no compile
cache and a matching known-bad row are warnings; a row with ``refuse = true`` that matches for
certain stops the start (exit 78). A profile's ``allow_known_bad`` silences the rows it names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from gpuswapd.adapters.docker import read_env_file
from gpuswapd.checks import caches as caches_
from gpuswapd.checks.caches import Cache
from gpuswapd.checks.knownbad import Match, Table
from gpuswapd.config import DEFAULT_PROFILE, Config, Profile
from gpuswapd.errors import DockerError
from gpuswapd.logs import log
from gpuswapd.parts.engineview import EngineView, from_config


@dataclass(frozen=True)
class ProfileCheck:
    """What one engine profile's settings come to: its caches, the rows it meets, the rows it allows."""

    profile: str
    where: str  # "window" or "profiles.NAME", as its keys are named
    view: EngineView
    caches: list[Cache]
    matches: list[Match]  # the rows in effect (not allowed)
    allowed: list[tuple[str, Match | None]] = field(default_factory=list)  # allow_known_bad: id, what it silenced
    unknown: list[str] = field(default_factory=list)  # allow_known_bad ids that no row has

    def cache_warning(self) -> str | None:
        """Say what keeping no compile cache costs; None if a cache is kept (or the container stays)."""
        return caches_.warning(self.where, self.view, self.caches)

    def warnings(self) -> list[str]:
        """List the warnings: no compile cache kept, each known-bad row met, each allow of no row."""
        out = [w for w in [self.cache_warning()] if w is not None]
        for m in self.matches:
            if m.row.refuse and m.certain:
                continue  # a refusal, not a warning
            then = ""
            if m.row.refuse:
                then = ("; this row refuses to start (refuse = true) once the context is known to match: set "
                        "--max-model-len, or allow the row")
            out.append(f"{self.where}: known-bad setting {m.row.id} ({m.detail()}): {m.row.reason} "
                       f"[source: {m.row.source}]{then}; change the setting, or silence the row with "
                       f"{self.where}.allow_known_bad = [\"{m.row.id}\"]")
        for row_id in self.unknown:
            out.append(f"{self.where}.allow_known_bad: no known-bad row has the id {row_id!r} (removed from the "
                       "table, or misspelt?): it silences nothing")
        return out

    def refusals(self) -> list[str]:
        """List the rows with ``refuse = true`` that these settings meet for certain, as errors."""
        return [f"{self.where}: known-bad setting {m.row.id} refuses this engine ({m.detail()}): {m.row.reason} "
                f"[source: {m.row.source}]; change the setting, or allow it with {self.where}.allow_known_bad = "
                f"[\"{m.row.id}\"]" for m in self.matches if m.row.refuse and m.certain]

    def to_dict(self) -> dict[str, Any]:
        """Describe the caches and the rows met, for ``plan``."""
        return {"from": self.view.origin, "caches": [c.to_dict() for c in self.caches] if self.view.create else [],
                "known_bad": [{"id": m.row.id, "refuse": m.row.refuse, "certain": m.certain, "matched": m.detail()}
                              for m in self.matches],
                "allowed": [{"id": row_id, "matched": None if m is None else m.detail()}
                            for row_id, m in self.allowed]}


def where(profile: Profile) -> str:
    """Name a profile's table as its keys are named: "window" or "profiles.NAME"."""
    return "window" if profile.name == DEFAULT_PROFILE else f"profiles.{profile.name}"


def check(profile: Profile, view: EngineView, table: Table) -> ProfileCheck:
    """Check one engine profile's settings against the caches it should keep and the known-bad table."""
    allow = profile.engine.allow_known_bad
    found = table.matches(view.image, view.env, view.argv)
    in_effect = [m for m in found if m.row.id not in allow]
    allowed = [(row_id, next((m for m in found if m.row.id == row_id), None)) for row_id in allow]
    unknown = [row_id for row_id in allow if row_id not in table.ids]
    return ProfileCheck(profile.name, where(profile), view, caches_.compile_caches(view), in_effect, allowed, unknown)


def configured_view(profile: Profile) -> EngineView:
    """Describe a profile's container from the configuration alone (its env file read if it can be)."""
    c = profile.engine.container
    file_env: dict[str, str] = {}
    if c.env_file:
        with contextlib.suppress(DockerError):  # the window's preflight says so, with the file's name
            file_env = read_env_file(c.env_file)
    return from_config(c, file_env)


def check_config(config: Config, table: Table) -> list[ProfileCheck]:
    """Check every engine profile as the configuration describes it (``--check-config``)."""
    return [check(p, configured_view(p), table) for p in config.engine_profiles()]


def log_check(found: ProfileCheck, log: Any = log) -> None:
    """Log at start what a profile's check found: each warning, and each allowed row (``log``: a test's)."""
    warned = found.cache_warning()
    if warned is not None:
        log.warning("compile_cache_not_kept", profile=found.profile, detail=warned)
    for m in found.matches:
        if not (m.row.refuse and m.certain):
            log.warning("known_bad_setting", profile=found.profile, row=m.row.id, matched=m.detail(),
                        certain=m.certain, reason=m.row.reason, source=m.row.source, refuse=m.row.refuse)
    for row_id, silenced in found.allowed:
        log.info("known_bad_allowed", profile=found.profile, row=row_id, known=row_id not in found.unknown,
                 matched=None if silenced is None else silenced.detail(),
                 key=f"{found.where}.allow_known_bad")
