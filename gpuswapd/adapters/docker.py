"""Docker (the docker SDK): the engine's container, created, started, watched, stopped, removed.

The SDK is synchronous: the asyncio core calls these methods from a worker thread. One client
serves every thread (its connection pool is thread-safe); it is made on first use, so gpuswapd
can start before dockerd does and a failed connection is retried by the next call.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import docker
import docker.errors
import requests.exceptions
import urllib3.exceptions
from docker.types import DeviceRequest
from docker.utils import kwargs_from_env

from gpuswapd.config import ContainerConfig
from gpuswapd.errors import ContainerNotFound, DockerError, DockerUnavailable, ImageNotFound

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT_HOST = "unix:///var/run/docker.sock"
_ALIVE = frozenset({"running", "paused", "restarting"})  # Docker's State.Running is true for these
_ENDED = frozenset({"exited", "dead"})
_ZERO_TIME = "0001-01-01T00:00:00Z"
_WATCHED = ("die", "stop", "start", "oom", "destroy")
_NO_IMAGE = re.compile(r"no such image: (\S+)", re.IGNORECASE)
_NAME_IN_USE = re.compile(r'name "/?([^"]+)" is already in use by container "([0-9a-f]+)"')
_UNREACHABLE = (
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,  # the connection dropped mid-answer
    requests.exceptions.Timeout,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    FileNotFoundError,
)
_SDK_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, *_UNREACHABLE)
_ENV_BLANKS = " \t"
_UTF8_BOM = "\ufeff"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_CONVENTIONAL = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")  # a name an error may show
_STOP_POLL_S = 0.1


@dataclass(frozen=True)
class ContainerState:
    """What Docker says about a container right now."""

    id: str
    name: str
    status: str  # Docker's: created, running, restarting, exited, dead, paused (or removing)
    exit_code: int | None  # None until the container has exited
    oom_killed: bool
    started_at: str  # RFC 3339 as Docker gives it; "" if never started
    finished_at: str  # RFC 3339 as Docker gives it; "" if never finished
    labels: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def running(self) -> bool:
        """Tell whether the container's process is alive (also while paused or restarting)."""
        return self.status in _ALIVE


@dataclass(frozen=True)
class DockerMount:
    """One mount of a container, as Docker lists it."""

    kind: str  # "bind", "volume", "tmpfs", ...
    source: str
    target: str
    writable: bool


@dataclass(frozen=True)
class RunSettings:
    """What an image or a container runs with: environment, command line, user, mounts."""

    image: str
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    user: str  # "" is root
    mounts: list[DockerMount] = field(default_factory=list)


def _env_list(items: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, _, value = str(item).partition("=")
        out[key] = value
    return out


def _argv(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value or []]


def _settings_of(data: dict[str, Any], image: str, container: bool) -> RunSettings:
    """Build RunSettings from ``docker inspect`` output of an image or (``container``) a container."""
    cfg = data.get("Config") or {}
    mounts = [DockerMount(str(m.get("Type", "")), str(m.get("Source") or m.get("Name") or ""),
                          str(m.get("Destination", "")), bool(m.get("RW", True)))
              for m in data.get("Mounts") or []] if container else []
    if container:  # what it really runs: Path and Args (the entrypoint and command, resolved)
        return RunSettings(str(cfg.get("Image") or image), _env_list(cfg.get("Env")),
                           [str(data.get("Path") or "")] if data.get("Path") else [], _argv(data.get("Args")),
                           str(cfg.get("User") or ""), mounts)
    return RunSettings(image, _env_list(cfg.get("Env")), _argv(cfg.get("Entrypoint")), _argv(cfg.get("Cmd")),
                       str(cfg.get("User") or ""))


def _state_of(data: dict[str, Any]) -> ContainerState:
    """Build a ContainerState from ``docker inspect`` output."""
    state = data.get("State") or {}
    status = str(state.get("Status", ""))
    labels = (data.get("Config") or {}).get("Labels") or {}
    return ContainerState(
        id=str(data.get("Id", "")),
        name=str(data.get("Name", "")).lstrip("/"),
        status=status,
        exit_code=int(state.get("ExitCode", 0)) if status in _ENDED else None,
        oom_killed=bool(state.get("OOMKilled", False)),
        started_at=_time(state.get("StartedAt")),
        finished_at=_time(state.get("FinishedAt")),
        labels={str(k): str(v) for k, v in labels.items()},
    )


def _time(value: Any) -> str:
    text = str(value or "")
    return "" if text == _ZERO_TIME else text


def _reason(err: BaseException) -> str:
    """Dig out the innermost cause of a transport error (``Connection refused``)."""
    inner: BaseException = err
    for _ in range(10):
        nested = inner.__cause__ or inner.__context__ or next(
            (a for a in inner.args if isinstance(a, BaseException)), None
        )
        if nested is None:
            break
        inner = nested
    if isinstance(inner, OSError) and inner.strerror:
        return inner.strerror
    return str(inner)


def _translate(err: Exception, doing: str, subject: str, where: str) -> DockerError:
    """Map a docker SDK or transport error to the most specific error of gpuswapd."""
    if isinstance(err, _UNREACHABLE) or (
        isinstance(err, docker.errors.DockerException)
        and "Error while fetching server API version" in str(err)
    ):
        return DockerUnavailable(
            f"Docker is not answering at {where} ({_reason(err)}): "
            "is dockerd running? Check `systemctl status docker`"
        )
    if isinstance(err, docker.errors.APIError):
        return _api_error(err, doing, subject)
    return DockerError(f"Docker could not {doing}{_quoted(subject)}: {err}")


def _api_error(err: docker.errors.APIError, doing: str, subject: str) -> DockerError:
    text = str(err.explanation or err)
    image = _NO_IMAGE.search(text)
    if isinstance(err, docker.errors.ImageNotFound) or image:
        name = image.group(1) if image else subject
        return ImageNotFound(
            f"image {name!r} not found in Docker: `docker pull {name}` or `docker load` it"
        )
    if err.status_code == 404 and "no such container" in text.lower():
        return ContainerNotFound(
            f"cannot {doing} container {subject!r}: Docker has no such container "
            "(`docker ps -a` lists them)"
        )
    in_use = _NAME_IN_USE.search(text)
    if err.status_code == 409 and in_use:
        name, cid = in_use.groups()
        return DockerError(
            f"a container named {name!r} already exists in Docker (id {cid[:12]}): "
            f"remove it with `docker rm -f {name}`"
        )
    if "could not select device driver" in text:
        return DockerError(
            f"cannot {doing} container {subject!r}: Docker cannot give it the GPU ({text}): "
            "the NVIDIA container toolkit is missing; install nvidia-container-toolkit, run "
            "`nvidia-ctk runtime configure --runtime=docker` and restart docker"
        )
    return DockerError(f"Docker could not {doing}{_quoted(subject)}: {text}")


def _quoted(subject: str) -> str:
    return f" {subject!r}" if subject else ""


def _subject(args: tuple[Any, ...]) -> str:
    """Name what a call is about: its first argument (a container name, an image, a spec)."""
    first = args[0] if args else ""
    if isinstance(first, ContainerConfig):
        return first.name
    if isinstance(first, list):
        return ", ".join(map(str, first))
    if isinstance(first, dict):
        return ", ".join(f"{k}={v}" for k, v in first.items())
    return str(first)


def _docker_errors(doing: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Turn docker SDK and transport errors raised by a ``Docker`` method into gpuswapd's own."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return func(*args, **kwargs)
            except _SDK_ERRORS as err:
                where = getattr(args[0], "where", "?")
                raise _translate(err, doing, _subject(args[1:]), where) from err

        return wrapper

    return decorate


def read_env_file(path: str) -> dict[str, str]:
    """Read variables in Docker's ``--env-file`` format (a bare KEY passes gpuswapd's own value)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as err:  # its message would quote the bytes, which may be a secret's
        raise DockerError(f"cannot read the env file {path!r} ([window.container] env_file): not UTF-8 "
                          f"(at byte {err.start})") from None
    except OSError as err:
        raise DockerError(
            f"cannot read the env file {path!r} ([window.container] env_file): {err}"
        ) from err
    out: dict[str, str] = {}
    for number, raw in enumerate(text.removeprefix(_UTF8_BOM).split("\n"), start=1):
        line = raw.removesuffix("\r").lstrip()
        if not line or line.startswith("#"):
            continue
        key, has_value, value = line.partition("=")
        if not key or any(c in key for c in _ENV_BLANKS) or (not has_value and not _ENV_NAME.fullmatch(key)):
            # Name the line and the variable, never the rest: a mistyped line may hold a token (the
            # window's error, and so this message, is in every local user's `gpuswapctl status`).
            raise DockerError(f"env file {path!r} line {number}: {_env_problem(key)}: write KEY=VALUE "
                              "(the line is not shown: it may hold a secret)")
        if has_value:
            out[key] = value
        elif key in os.environ:
            out[key] = os.environ[key]
    return out


def _env_problem(key: str) -> str:
    """Say what is wrong with an env file line, naming its variable only if it looks like one (KEY_NAME)."""
    if not key:
        return "no variable name"
    name = _ENV_NAME.match(key)
    if name is None:
        return "it does not start with a variable name"
    after = "whitespace" if key[len(name.group(0)):][:1] in _ENV_BLANKS else "other text"
    if not _CONVENTIONAL.fullmatch(name.group(0)):  # a pasted token looks like this: do not show it
        return f"its first word is followed by {after} (not shown: not a KEY_NAME, it may be a value)"
    return f"variable {name.group(0)!r} is followed by {after}"


def pids_of(listing: Any) -> list[int]:
    """Read the PID column of ``docker top`` (its columns depend on the ps options)."""
    if not isinstance(listing, dict):
        return []
    titles = listing.get("Titles") or []
    column = titles.index("PID") if "PID" in titles else None
    out = []
    for row in listing.get("Processes") or []:
        if column is not None and column < len(row):
            try:
                out.append(int(row[column]))
            except (TypeError, ValueError):
                continue
    return out


def _environment(spec: ContainerConfig) -> list[str]:
    """Merge the ``env`` table over the env file, as ``KEY=VALUE`` strings."""
    merged = read_env_file(spec.env_file) if spec.env_file else {}
    merged.update(spec.env)
    return [f"{k}={v}" for k, v in merged.items()]


def _exposed(port: str) -> tuple[str, str]:
    """Split "8000/tcp" for the SDK, which appends "/tcp" to a plain string ("8000/tcp/tcp")."""
    number, _, proto = port.partition("/")
    return number, proto or "tcp"


def _device_requests(gpus: str | list[int]) -> list[DeviceRequest]:
    """Translate ``gpus`` like ``docker run --gpus``: "all", a list of indexes, or none."""
    if gpus == "all":
        return [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if gpus:
        return [DeviceRequest(device_ids=[str(i) for i in gpus], capabilities=[["gpu"]])]
    return []


class Docker:
    """A connection to the Docker engine."""

    def __init__(self, base_url: str | None = None, timeout: float = 30.0) -> None:
        if base_url is not None:
            self._params: dict[str, Any] = {"base_url": base_url}
            self.where = base_url
        else:
            # Like docker.from_env(): DOCKER_HOST and DOCKER_TLS_VERIFY / DOCKER_CERT_PATH.
            self._params = kwargs_from_env()
            if "base_url" in self._params:
                self.where = f"{self._params['base_url']} (DOCKER_HOST)"
            else:
                self._params["base_url"] = _DEFAULT_HOST
                self.where = f"{_DEFAULT_HOST} (the default; DOCKER_HOST is not set)"
        self._timeout = timeout
        self._lock = threading.Lock()
        self._client: docker.DockerClient | None = None

    def _api(self) -> Any:
        """Return the low-level API client, connecting (and negotiating the version) once."""
        with self._lock:
            if self._client is None:
                self._client = docker.DockerClient(
                    version="auto", timeout=self._timeout, **self._params
                )
            return self._client.api

    @_docker_errors("reach")
    def ping(self) -> None:
        """Check that the engine answers."""
        self._api().ping()

    @_docker_errors("inspect image")
    def image_present(self, image: str) -> bool:
        """Tell whether the image is in the engine's image store."""
        try:
            self._api().inspect_image(image)
        except docker.errors.NotFound:
            return False
        return True

    @_docker_errors("inspect image")
    def image_settings(self, image: str) -> RunSettings | None:
        """Read what an image runs with (its ENV, ENTRYPOINT, CMD, USER); None if there is no such image."""
        try:
            return _settings_of(self._api().inspect_image(image), image, container=False)
        except docker.errors.NotFound:
            return None

    @_docker_errors("inspect")
    def container_settings(self, name: str) -> RunSettings | None:
        """Read what a container runs with (environment, command line, user, mounts); None if there is none."""
        try:
            return _settings_of(self._api().inspect_container(name), "", container=True)
        except docker.errors.NotFound:
            return None

    @_docker_errors("inspect")
    def state(self, name: str) -> ContainerState | None:
        """Read a container's state; None if there is no such container."""
        return self._inspect(name)

    def _inspect(self, name: str) -> ContainerState | None:
        try:
            return _state_of(self._api().inspect_container(name))
        except docker.errors.NotFound:
            return None

    @_docker_errors("create")
    def create(self, spec: ContainerConfig, labels: dict[str, str]) -> str:
        """Create (not start) the container ``[window.container]`` describes; return its id."""
        api = self._api()
        published = spec.ports if spec.network_mode != "host" else {}
        host_config = api.create_host_config(
            binds=[f"{host}:{target}" for host, target in spec.volumes.items()] or None,
            port_bindings=dict(published) or None,
            network_mode=spec.network_mode or None,
            device_requests=_device_requests(spec.gpus) or None,
            shm_size=spec.shm_size or None,
        )
        created = api.create_container(
            image=spec.image,
            name=spec.name,
            command=list(spec.command) or None,
            environment=_environment(spec),
            labels=dict(labels),
            ports=[_exposed(port) for port in published] or None,
            host_config=host_config,
        )
        return str(created["Id"])

    @_docker_errors("start")
    def start(self, name: str) -> str:
        """Start a created or stopped container (no error if it runs already); return its StartedAt.

        StartedAt names this start: a later restart of the container changes it ("" if Docker
        does not say, or the container is gone already).
        """
        self._api().start(name)
        state = self._inspect(name)
        return state.started_at if state is not None else ""

    @_docker_errors("stop")
    def stop(self, name: str, timeout: float) -> None:
        """Send SIGTERM, then SIGKILL after ``timeout`` seconds; no error if stopped or absent."""
        try:
            # Docker takes whole seconds; round up so the engine gets at least what was asked.
            self._api().stop(name, timeout=math.ceil(max(timeout, 0.0)))
        except docker.errors.NotFound:
            return

    @_docker_errors("remove")
    def remove(self, name: str) -> None:
        """Remove the container, killing it if it runs; no error if absent."""
        try:
            self._api().remove_container(name, force=True)
        except docker.errors.NotFound:
            return

    @_docker_errors("wait for")
    def wait_exit(self, name: str, timeout: float) -> ContainerState | None:
        """Block until the container is not running and return its state; None on timeout."""
        if timeout > 0:
            try:
                self._api().wait(name, timeout=timeout, condition="not-running")
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as err:
                # Docker sends the headers at once, so the SDK's wait timeout surfaces while
                # reading the body: requests reports it as a ConnectionError around a read timeout.
                if not _is_read_timeout(err):
                    raise
                return None
        state = self._inspect(name)
        if state is None:
            raise ContainerNotFound(
                f"container {name!r} was removed while gpuswapd waited for it to exit"
            )
        return None if state.running else state

    @_docker_errors("list the processes of")
    def top(self, name: str) -> list[int]:
        """List the host pids of the container's processes (``docker top``); none if it does not run."""
        try:
            listing = self._api().top(name)
        except docker.errors.NotFound:
            return []
        except docker.errors.APIError as err:
            if getattr(err, "status_code", None) == 409:  # "is not running"
                return []
            raise
        return pids_of(listing)

    @_docker_errors("read the logs of")
    def logs_tail(self, name: str, lines: int = 20) -> str:
        """Return the last ``lines`` lines of the container's stdout and stderr."""
        raw = self._api().logs(name, stdout=True, stderr=True, tail=lines)
        return bytes(raw).decode("utf-8", errors="replace")

    @_docker_errors("list containers labelled")
    def find(self, labels: dict[str, str]) -> list[ContainerState]:
        """List containers (any status) that carry all these labels."""
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        found = []
        for summary in self._api().containers(all=True, filters=filters):
            state = self._inspect(summary["Id"])
            if state is not None:  # it may have been removed since the listing
                found.append(state)
        return found

    def events(self, names: list[str], stop: threading.Event) -> Iterator[tuple[str, str]]:
        """Yield ``(name, action)`` for die/stop/start/oom/destroy of ``names`` until ``stop``."""
        wanted = set(names)
        try:
            stream = self._api().events(
                filters={"type": "container", "container": names, "event": list(_WATCHED)},
                decode=True,
            )
            with _closed_when_set(stream, stop):
                for event in stream:
                    if stop.is_set():
                        return
                    action = str(event.get("Action") or event.get("status") or "")
                    name = str(((event.get("Actor") or {}).get("Attributes") or {}).get("name", ""))
                    if name in wanted and action in _WATCHED:
                        yield name, action
        except _SDK_ERRORS as err:
            if stop.is_set():
                return
            raise _translate(err, "watch events of", ", ".join(names), self.where) from err
        if not stop.is_set():
            # The SDK ends the stream quietly when the connection drops: dockerd went away.
            raise DockerUnavailable(
                f"Docker's event stream at {self.where} ended: dockerd stopped or restarted; "
                "check `systemctl status docker`"
            )


def _is_read_timeout(err: BaseException) -> bool:
    if isinstance(err, requests.exceptions.ReadTimeout):
        return True
    return any(isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in err.args)


@contextlib.contextmanager
def _closed_when_set(stream: Any, stop: threading.Event) -> Iterator[None]:
    """Close ``stream`` from a helper thread once ``stop`` is set: its reader blocks in recv()."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_STOP_POLL_S):
            if stop.is_set():
                stream.close()
                return

    watcher = threading.Thread(target=watch, name="docker-events-stop", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        with contextlib.suppress(OSError):
            stream.close()
