"""Which tenant serves which model: the resident (its names from its own ``/v1/models``) or a profile.

A profile's names are its ``serves``; the resident's are what ``GET {gateway.resident}/v1/models``
said while it was up, remembered in ``$STATE_DIRECTORY/resident-models.json`` (the unit's
``StateDirectory=``) so that a gateway started during a window still knows them, and always
``resident.verify.model``. The configuration refuses a name that two profiles, or a profile and
``resident.verify.model``, serve; a name the resident lists that a profile also serves goes to the
profile, and the log says so once.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpuswapd.config import Config
from gpuswapd.logs import log

RESIDENT = "resident"
NAMES_FILE = "resident-models.json"


@dataclass(frozen=True)
class Tenant:
    """Where a model is served: the resident, or the engine of a profile."""

    name: str  # "resident", or the profile's name
    base: str  # the server's base URL, without /v1

    @property
    def engine(self) -> bool:
        """Tell whether this tenant is an engine profile (served in a window)."""
        return self.name != RESIDENT


class Tenants:
    """The routing table."""

    def __init__(self, config: Config, state_dir: str | None = None) -> None:
        self.resident = Tenant(RESIDENT, config.gateway.resident)
        self.engines: dict[str, Tenant] = {}
        self._serves: dict[str, Tenant] = {}
        for p in config.engine_profiles():
            if p.engine.serves:
                tenant = Tenant(p.name, p.engine.api_base)
                self.engines[p.name] = tenant
                self._serves.update(dict.fromkeys(p.engine.serves, tenant))
        self._verify_model = config.resident.verify.model
        self._file = Path(state_dir) / NAMES_FILE if state_dir else None
        self._warned: set[str] = set()
        self.resident_names = self._remembered()

    @classmethod
    def from_environment(cls, config: Config) -> Tenants:
        """Build the table, remembering the resident's names in systemd's ``$STATE_DIRECTORY``, if any."""
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        return cls(config, state or None)

    def route(self, model: str) -> Tenant | None:
        """Return the tenant that serves ``model`` (None: nobody does)."""
        tenant = self._serves.get(model)
        if tenant is not None:
            return tenant
        return self.resident if model in self.resident_names else None

    def served(self) -> list[tuple[str, Tenant]]:
        """List every model name with its tenant: the resident's first, then each profile's."""
        out = [(name, self.resident) for name in self.resident_names if name not in self._serves]
        return out + list(self._serves.items())

    def learn(self, names: list[str]) -> bool:
        """Take the names the resident lists now; tell whether they changed (then ``save`` them)."""
        for name in names:
            if name in self._serves and name not in self._warned:
                self._warned.add(name)
                log.warning("gateway_model_shadowed", model=name, profile=self._serves[name].name,
                            reason="the resident lists a name a profile serves: requests for it open the profile")
        known = sorted({self._verify_model, *names})
        if known == self.resident_names:
            return False
        self.resident_names = known
        log.info("gateway_resident_models", models=known)
        return True

    def save(self) -> None:
        """Remember the resident's names in the state directory (a blocking write: run it off the loop)."""
        if self._file is None:
            return
        try:
            tmp = self._file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"models": self.resident_names}))
            tmp.replace(self._file)
        except OSError as err:
            log.warning("gateway_models_not_saved", file=str(self._file), error=str(err))

    def _remembered(self) -> list[str]:
        names: list[str] = []
        if self._file is not None:
            with contextlib.suppress(OSError, ValueError, TypeError):
                data = json.loads(self._file.read_text())
                names = [str(n) for n in data["models"] if isinstance(n, str)]
        return sorted({self._verify_model, *names})
