"""The errors of gpuswapd, one tree, each with a stable ``code`` the socket carries.

    GpuswapError                     error
    ├── ConfigError                  config
    ├── RequestError                 bad_request
    │   ├── PermissionDenied         permission_denied
    │   ├── TooManyClients           too_many_clients
    │   ├── LeaseNotFound            lease_not_found
    │   ├── NotFound                 not_found
    │   ├── NotReady                 not_ready
    │   ├── UnknownProfile           unknown_profile
    │   └── QueueFull                queue_full
    ├── WindowError                  window_failed
    │   ├── ResidentBusy             resident_busy
    │   ├── WontFit                  wont_fit
    │   ├── VramTimeout              vram_timeout
    │   ├── EngineFailed             engine_failed
    │   ├── VerifyFailed             verify_failed
    │   ├── RestoreFailed            restore_failed
    │   ├── WindowCancelled          window_cancelled
    │   │   └── Stopping             stopping
    │   ├── Degraded                 degraded
    │   └── AcquireTimeout           acquire_timeout
    ├── StateError                   state
    ├── SystemdError                 systemd
    │   ├── BusUnavailable           dbus_unavailable
    │   ├── UnitNotFound             no_such_unit
    │   └── JobFailed                job_failed
    ├── DockerError                  docker
    │   ├── DockerUnavailable        docker_unavailable
    │   ├── ImageNotFound            image_not_found
    │   └── ContainerNotFound        container_not_found
    ├── GpuProbeError                gpu_probe
    ├── FilesError                   files
    └── EndpointError                endpoint
        ├── EndpointUnreachable      endpoint_unreachable
        ├── EndpointTimeout          endpoint_timeout
        └── BadResponse              bad_response

Adapters raise the most specific subclass, ``from`` the library's error. The window tags an
error with the phase it happened in; ``to_dict`` is what the socket and the state file carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class GpuswapError(Exception):
    """The root of every error gpuswapd raises on purpose."""

    code = "error"

    def __init__(self, message: str, *, phase: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.phase = phase

    def to_dict(self) -> dict[str, Any]:
        """Serialize for the socket protocol and the state file."""
        return _error_dict(self.code, self.message, self.phase)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuswapError:
        """Rebuild an error (of the class its code names) from ``to_dict`` output."""
        klass = _BY_CODE.get(str(data.get("code")), GpuswapError)
        err = klass(str(data.get("message", "")), phase=data.get("phase"))
        return err


class ConfigError(GpuswapError):
    """The configuration file is missing, unreadable or invalid."""

    code = "config"


class RequestError(GpuswapError):
    """A client's request is malformed or cannot be served."""

    code = "bad_request"


class PermissionDenied(RequestError):
    """The client may not ask for this."""

    code = "permission_denied"


class TooManyClients(RequestError):
    """The caller has too many connections open (``daemon.max_clients_per_uid``, ``max_clients``)."""

    code = "too_many_clients"


class LeaseNotFound(RequestError):
    """No such lease (or none held by this holder)."""

    code = "lease_not_found"


class NotFound(RequestError):
    """There is nothing of what the request names (no parked engine, say)."""

    code = "not_found"


class NotReady(RequestError):
    """The window is not open and the client asked not to wait."""

    code = "not_ready"


class UnknownProfile(RequestError):
    """The request names a profile the configuration does not have."""

    code = "unknown_profile"


class QueueFull(RequestError):
    """``daemon.max_queue`` requests wait already."""

    code = "queue_full"


class WindowError(GpuswapError):
    """The window could not be opened or kept: the GPU was not obtained."""

    code = "window_failed"


class ResidentBusy(WindowError):
    """The resident still has requests in flight."""

    code = "resident_busy"


class WontFit(WindowError):
    """The window cannot fit on the card: other processes hold too much of it."""

    code = "wont_fit"


class VramTimeout(WindowError):
    """VRAM did not come free in time."""

    code = "vram_timeout"


class EngineFailed(WindowError):
    """The engine did not come up, or died and could not be brought back."""

    code = "engine_failed"


class VerifyFailed(WindowError):
    """A verifying completion was not answered."""

    code = "verify_failed"


class RestoreFailed(WindowError):
    """The resident could not be started again."""

    code = "restore_failed"


class WindowCancelled(WindowError):
    """The window was abandoned: its last waiter went away or gpuswapd is stopping."""

    code = "window_cancelled"


class Stopping(WindowCancelled):
    """gpuswapd is stopping: waiting requests are not kept across a restart."""

    code = "stopping"


class Degraded(WindowError):
    """The resident could not be restored yet; no new window opens until it is."""

    code = "degraded"


class AcquireTimeout(WindowError):
    """The window was not ready within the time the client would wait."""

    code = "acquire_timeout"


class StateError(GpuswapError):
    """The state directory cannot be read or written."""

    code = "state"


class SystemdError(GpuswapError):
    """systemd refused or failed a request."""

    code = "systemd"


class BusUnavailable(SystemdError):
    """The system bus or systemd cannot be reached."""

    code = "dbus_unavailable"


class UnitNotFound(SystemdError):
    """systemd knows no unit of that name."""

    code = "no_such_unit"


class JobFailed(SystemdError):
    """A start or stop job ended with a result other than done."""

    code = "job_failed"


class DockerError(GpuswapError):
    """The Docker engine refused or failed a request."""

    code = "docker"


class DockerUnavailable(DockerError):
    """The Docker engine cannot be reached."""

    code = "docker_unavailable"


class ImageNotFound(DockerError):
    """The configured image is not present."""

    code = "image_not_found"


class ContainerNotFound(DockerError):
    """The configured container does not exist."""

    code = "container_not_found"


class GpuProbeError(GpuswapError):
    """The GPU's memory could not be read."""

    code = "gpu_probe"


class FilesError(GpuswapError):
    """The resident's model files could not be measured or read ahead (the page cache, the disk)."""

    code = "files"


class EndpointError(GpuswapError):
    """An HTTP endpoint of a model server failed."""

    code = "endpoint"


class EndpointUnreachable(EndpointError):
    """Nothing answers at the endpoint."""

    code = "endpoint_unreachable"


class EndpointTimeout(EndpointError):
    """The endpoint did not answer in time."""

    code = "endpoint_timeout"


class BadResponse(EndpointError):
    """The endpoint answered with an error status or something unreadable."""

    code = "bad_response"


def _subclasses(cls: type[GpuswapError]) -> list[type[GpuswapError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_subclasses(sub))
    return out


_BY_CODE: dict[str, type[GpuswapError]] = {c.code: c for c in _subclasses(GpuswapError)}


@dataclass(frozen=True)
class ErrorRecord:
    """An error as the window record keeps it: its code, its message, the phase it happened in."""

    code: str
    message: str
    phase: str | None = None

    @classmethod
    def of(cls, err: GpuswapError) -> ErrorRecord:
        """Record ``err``."""
        return cls(err.code, err.message, err.phase)

    def error(self) -> GpuswapError:
        """Rebuild the error (of the class its code names)."""
        return GpuswapError.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """Serialize as ``GpuswapError.to_dict`` does."""
        return _error_dict(self.code, self.message, self.phase)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ErrorRecord:
        """Rebuild from ``to_dict`` output (an older record's missing fields read as GpuswapError's)."""
        phase = data.get("phase")
        return cls(str(data.get("code", GpuswapError.code)), str(data.get("message", "")),
                   phase if isinstance(phase, str) else None)


def _error_dict(code: str, message: str, phase: str | None) -> dict[str, Any]:
    """Write an error as the wire and the state file carry it: its code, its message, the phase if any."""
    out: dict[str, Any] = {"code": code, "message": message}
    if phase is not None:
        out["phase"] = phase
    return out
