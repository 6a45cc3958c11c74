"""The configuration: TOML, every key validated at start, errors that name the key."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import typing
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from gpuswapd.errors import ConfigError
from gpuswapd.events import KNOWN_EVENTS
from gpuswapd.sizes import SizeError, parse_size
from gpuswapd.timespan import SpanError, parse_span

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli stays the fallback the package declares
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_PATH = Path("/etc/gpuswapd/gpuswapd.toml")
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]+\.(service|socket|target|timer|mount|path|scope|slice)$")

T = TypeVar("T")
Parser = Callable[[Any, str], Any]


_REQUIRED: Any = object()


def _key(parse: Parser, default: Any = _REQUIRED) -> Any:
    """Declare a config key with its parser and its default (none: the key is required)."""
    if default is _REQUIRED:
        return field(metadata={"parse": parse})
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"parse": parse})
    return field(default=default, metadata={"parse": parse})


def _fail(path: str, why: str) -> ConfigError:
    return ConfigError(f"{path}: {why}")


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, f"expected a string, got {type(value).__name__}")
    return value


def _nonempty(value: Any, path: str) -> str:
    text = _string(value, path)
    if not text.strip():
        raise _fail(path, "must not be empty")
    return text


def _url(value: Any, path: str) -> str:
    text = _string(value, path)
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", text):
        raise _fail(path, f"not an http(s) URL: {text!r}")
    return text


def _optional_url(value: Any, path: str) -> str:
    return "" if _string(value, path) == "" else _url(value, path)


def _span(minimum: float = 0.0) -> Parser:
    def parse(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise _fail(path, f"expected a time span such as '15m', got {type(value).__name__}")
        try:
            seconds = parse_span(str(value)) if isinstance(value, str) else float(value)
        except SpanError as err:
            raise _fail(path, str(err)) from None
        except OverflowError:  # an integer of hundreds of digits
            seconds = float("inf")
        if not seconds >= minimum or seconds == float("inf"):
            shown = value if len(str(value)) <= 40 else f"{str(value)[:40]}..."
            raise _fail(path, f"{shown!r} is out of range (must be finite and at least {minimum:g}s)")
        return seconds
    return parse


def _number(minimum: float, maximum: float) -> Parser:
    def parse(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, f"expected a number, got {type(value).__name__}")
        if not minimum <= value <= maximum:
            raise _fail(path, f"{value!r} is out of range ({minimum:g}..{maximum:g})")
        return float(value)
    return parse


def _size(value: Any, path: str) -> int:
    try:
        return parse_size(value)
    except SizeError as err:
        raise _fail(path, str(err)) from None


def _int(minimum: int, maximum: int = 2**31) -> Parser:
    def parse(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"expected an integer, got {type(value).__name__}")
        if not minimum <= value <= maximum:
            shown = str(value) if len(str(value)) <= 20 else f"{str(value)[:20]}... ({len(str(value))} digits)"
            raise _fail(path, f"{shown} is out of range ({minimum}..{maximum})")
        return value
    return parse


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"expected true or false, got {type(value).__name__}")
    return value


def _choice(*choices: str) -> Parser:
    def parse(value: Any, path: str) -> str:
        if value not in choices:
            raise _fail(path, f"{value!r} is not one of {', '.join(map(repr, choices))}")
        return str(value)
    return parse


def _strings(value: Any, path: str) -> list[str]:
    if not isinstance(value, list):
        raise _fail(path, f"expected a list of strings, got {type(value).__name__}")
    return [_string(v, f"{path}[{i}]") for i, v in enumerate(value)]


def _units(value: Any, path: str) -> list[str]:
    names = _strings(value, path)
    if not names:
        raise _fail(path, "must name at least one unit")
    for i, name in enumerate(names):
        if not _UNIT_NAME.match(name):
            raise _fail(f"{path}[{i}]", f"not a unit name: {name!r} (e.g. 'strata.service')")
    return names


def _unit_patterns(value: Any, path: str) -> list[str]:
    patterns = _strings(value, path)
    for i, pattern in enumerate(patterns):
        example = pattern.replace("*", "x").replace("?", "x")
        # A pattern that ends in '*' may match any unit type ("systemd-*").
        if not _UNIT_NAME.match(example) and not (pattern.endswith("*") and _UNIT_NAME.match(example + ".service")):
            raise _fail(f"{path}[{i}]", f"not a unit name or glob: {pattern!r} (e.g. 'gpuswapd@*.service')")
    return patterns


def _abs_paths(value: Any, path: str) -> list[str]:
    paths = _strings(value, path)
    for i, item in enumerate(paths):
        if not os.path.isabs(item):
            raise _fail(f"{path}[{i}]", f"must be an absolute path, got {item!r}")
    return paths


def _abs_path(value: Any, path: str) -> str:
    text = _string(value, path)
    if text and not os.path.isabs(text):
        raise _fail(path, f"must be an absolute path, got {text!r}")
    return text


def _timer_patterns(value: Any, path: str) -> list[str]:
    patterns = _strings(value, path)
    for i, pattern in enumerate(patterns):
        if not pattern.endswith(".timer"):
            raise _fail(f"{path}[{i}]", f"pattern must match timer units (end in .timer): {pattern!r}")
    return patterns


def _string_map(value: Any, path: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _fail(path, f"expected a table of strings, got {type(value).__name__}")
    return {str(k): _string(v, f"{path}.{k}") for k, v in value.items()}


def _ports(value: Any, path: str) -> dict[str, int]:
    if not isinstance(value, dict):
        raise _fail(path, f"expected a table such as {{ \"8000/tcp\" = 18020 }}, got {type(value).__name__}")
    out: dict[str, int] = {}
    for spec, port in value.items():
        if not re.fullmatch(r"\d{1,5}(/(tcp|udp|sctp))?", spec):
            raise _fail(f"{path}.{spec}", "container port must look like '8000/tcp'")
        out[spec] = _int(1, 65535)(port, f"{path}.{spec}")
    return out


def _gpus(value: Any, path: str) -> str | list[int]:
    if value == "all":
        return "all"
    if isinstance(value, list):
        return [_int(0, 64)(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise _fail(path, f"expected \"all\" or a list of device indexes, got {value!r}")


def _base_url(value: Any, path: str) -> str:
    if _string(value, path) == "":
        raise _fail(path, "must not be empty: an http(s) base URL such as \"http://127.0.0.1:8090\"")
    return _api_url(value, path)


def _api_url(value: Any, path: str) -> str:
    text = _string(value, path)
    if text and not re.match(r"^https?://[^/\s]+(/v1)?/?$", text):
        raise _fail(path, f"not an http(s) base URL such as \"http://127.0.0.1:18020\" (or ending in /v1): {text!r}")
    return text.rstrip("/").removesuffix("/v1")


def _model_names(value: Any, path: str) -> list[str]:
    names = _strings(value, path)
    for i, name in enumerate(names):
        if not name.strip() or not name.isprintable() or len(name) > 256:
            raise _fail(f"{path}[{i}]", f"not a model name: {name!r}")
        if name in names[:i]:
            raise _fail(f"{path}[{i}]", f"{name!r} is named twice")
    return names


def _docker_size(value: Any, path: str) -> str:
    text = _string(value, path)
    if text and not re.fullmatch(r"\d+[bkmgBKMG]?", text):
        raise _fail(path, f"not a Docker size: {text!r} (e.g. '16g')")
    return text


# Units a preemption never stops (daemon.never_stop): gpuswapd's own, and services that run the work
# of many users (a lease can be bound to them only by their main or control process, but a state
# document from before that rule, or a mistake, must not get cron stopped for everyone). One a line.
NEVER_STOP = [
    "gpuswapd.service",
    "gpuswapd.socket",
    "gpuswapd@*.service",
    "gpuswapd@*.socket",
    "gpuswapd-gateway.service",
    "gpuswapd-gateway.socket",
    "cron.service",
    "crond.service",
    "atd.service",
    "sshd.service",
    "ssh.service",
    "slurmd.service",
    "systemd-*",
]


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """``[daemon]``: the socket, the state and the lease rules."""

    socket: str = _key(_nonempty, "/run/gpuswapd/gpuswapd.sock")
    socket_group: str = _key(_string, "gpuswap")
    state_dir: str = _key(_nonempty, "/var/lib/gpuswapd")
    default_lease: float = _key(_span(1.0), 900.0)
    max_lease: float = _key(_span(1.0), 14400.0)
    linger: float = _key(_span(0.0), 30.0)
    on_shutdown: str = _key(_choice("restore", "keep"), "restore")
    status_public: bool = _key(_bool, True)
    call_timeout: float = _key(_span(0.5), 30.0)
    max_clients: int = _key(_int(1, 65536), 512)
    max_clients_per_uid: int = _key(_int(1, 65536), 32)
    reserved_clients: int = _key(_int(0, 65536), 32)
    max_queue: int = _key(_int(1, 65536), 64)
    fair_after: float = _key(_span(0.0), 300.0)
    # The share a request of another profile waits at most before the card moves to it: at least
    # fair_after, residency_factor times the price of the swaps it costs, at most residency_max.
    residency_factor: float = _key(_number(0.0, 1000.0), 6.0)
    residency_max: float = _key(_span(0.0), 900.0)
    reclaim_grace: float = _key(_span(0.0), 60.0)  # after a restart, a token reclaims its lease or place this long
    abandon_grace: float = _key(_span(0.0), 30.0)  # an opening whose last client hung up goes on this long
    priority_max_nonroot: int = _key(_int(-1000, 1000), 0)
    priority_min_nonroot: int = _key(_int(-1000, 1000), -10)
    aging: float = _key(_span(0.0), 600.0)
    preempt_grace: float = _key(_span(0.0), 30.0)
    reconcile: float = _key(_span(0.0), 30.0)  # how often an idle gpuswapd reports the resident down (0: never)
    never_stop: list[str] = _key(_unit_patterns, NEVER_STOP)


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    """``[gpu]``: how VRAM is read and how much each side needs."""

    probe: str = _key(_choice("nvml", "nvidia-smi", "none"), "nvml")
    index: int = _key(_int(0, 64), 0)
    window_needs: int = _key(_size, 21 * 1024**3)
    resident_needs: int = _key(_size, 22 * 1024**3)
    release_timeout: float = _key(_span(0.1), 60.0)
    nvidia_smi: str = _key(_nonempty, "nvidia-smi")
    probe_timeout: float = _key(_span(0.1), 10.0)


@dataclass(frozen=True, kw_only=True)
class IdleConfig:
    """``[resident.idle]``: how to tell whether a request is in flight on the resident."""

    kind: str = _key(_choice("llama.cpp-slots", "prometheus", "command", "gateway", "none"), "llama.cpp-slots")
    url: str = _key(_url, "http://127.0.0.1:8081/slots")
    metric: str = _key(_nonempty, "llamacpp:requests_processing")
    command: list[str] = _key(_strings, [])
    wait: float = _key(_span(0.0), 120.0)
    on_busy: str = _key(_choice("fail", "proceed"), "fail")


@dataclass(frozen=True, kw_only=True)
class CompletionCheck:
    """A real completion that proves a server answers (``[resident.verify]``, ``[window.verify]``)."""

    url: str = _key(_url)
    model: str = _key(_nonempty)
    prompt: str = _key(_nonempty, "Reply with the single word: ready")
    max_tokens: int = _key(_int(1, 1_000_000), 256)
    timeout: float = _key(_span(0.1), 180.0)


RESIDENT_SERVERS = ("llama.cpp", "other")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """``[resident.cache]``: llama.cpp's slots saved before the window and restored after it."""

    keep: str = _key(_choice("auto", "on", "off"), "auto")
    # llama-server's --slot-save-path ("": read from the resident's ExecStart=).
    save_path: str = _key(_abs_path, "")
    # llama-server's own /slots ("": props_url with /slots for /props).
    slots_url: str = _key(_optional_url, "")
    save_timeout: float = _key(_span(0.1), 5.0)
    max_size: int = _key(_size, 16 * 1024**3)


@dataclass(frozen=True, kw_only=True)
class ResidentConfig:
    """``[resident]``: the units that hold the GPU normally."""

    units: list[str] = _key(_units)
    stop_timeout: float = _key(_span(0.1), 90.0)
    start_timeout: float = _key(_span(0.1), 300.0)
    # What the resident is: llama.cpp's llama-server says its context and slots at props_url
    # (GET /props on the server itself, not through a proxy); any server lists its models.
    server: str = _key(_choice(*RESIDENT_SERVERS), "other")
    props_url: str = _key(_optional_url, "")
    # Its model files, read into the page cache during a close ([]: found from the units' ExecStart=).
    files: list[str] = _key(_abs_paths, [])
    prefetch: bool = _key(_bool, True)
    # gpuswapd starts only what it stopped; with this, the reconcile also starts a resident unit
    # that failed (never a masked or disabled one). Restarting a crashed service is Restart='s job.
    restart_crashed: bool = _key(_bool, False)
    idle: IdleConfig
    verify: CompletionCheck
    cache: CacheConfig

    @property
    def slots_url(self) -> str:
        """Return llama-server's own ``/slots``: ``cache.slots_url``, else ``props_url`` ending in ``/slots``."""
        if self.cache.slots_url:
            return self.cache.slots_url
        base = self.props_url.rstrip("/")
        return base[: -len("/props")] + "/slots" if base.endswith("/props") else ""

    @property
    def models_url(self) -> str:
        """Return where the resident lists its models: ``GET /v1/models`` on the base of verify.url."""
        url = self.verify.url
        scheme, _, rest = url.partition("://")
        host, _, path = rest.partition("/")
        prefix, found, _ = f"/{path}".partition("/v1/")
        return f"{scheme}://{host}{prefix if found else ''}/v1/models"


@dataclass(frozen=True, kw_only=True)
class TimersConfig:
    """``[timers]``: the agent timers paused for the window."""

    pause: list[str] = _key(_timer_patterns, [])
    wait_for_jobs: float = _key(_span(0.0), 300.0)


@dataclass(frozen=True, kw_only=True)
class ContainerConfig:
    """``[window.container]``: the engine's container."""

    name: str = _key(_nonempty)
    image: str = _key(_nonempty)
    create: bool = _key(_bool, True)
    env_file: str = _key(_string, "")
    env: dict[str, str] = _key(_string_map, {})
    ports: dict[str, int] = _key(_ports, {})
    volumes: dict[str, str] = _key(_string_map, {})
    network_mode: str = _key(_string, "")
    gpus: str | list[int] = _key(_gpus, "all")
    shm_size: str = _key(_docker_size, "")
    command: list[str] = _key(_strings, [])
    stop_timeout: float = _key(_span(0.0), 30.0)


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """``[window.warmup]``: completions that warm a cold engine."""

    requests: int = _key(_int(0, 1000), 3)
    prompt: str = _key(_nonempty, "Write a haiku about GPUs.")
    max_tokens: int = _key(_int(1, 1_000_000), 512)


@dataclass(frozen=True, kw_only=True)
class ParkConfig:
    """``[window.park]``: what happens to the engine at close."""

    mode: str = _key(_choice("stop", "sleep"), "stop")
    level: int = _key(_int(1, 2), 1)
    keep: float = _key(_span(1.0), 7200.0)
    host_ram_needs: int = _key(_size, 0)
    settle: float = _key(_span(0.0), 10.0)  # how long a sleeping engine's memory may take to come free


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    """``[window]``: the engine that owns the GPU during a window."""

    health_url: str = _key(_url)
    boot_timeout: float = _key(_span(0.1), 600.0)
    watch_interval: float = _key(_span(0.05), 10.0)
    max_restarts: int = _key(_int(0, 100), 2)
    container: ContainerConfig
    warmup: WarmupConfig
    verify: CompletionCheck
    park: ParkConfig
    # The gateway (gpuswapd-gateway): the model names that open this window on demand, and where
    # the engine's OpenAI API answers ("": the scheme, host and port of verify.url).
    serves: list[str] = _key(_model_names, [])
    api: str = _key(_api_url, "")
    # The known-bad table (gpuswapd.checks.knownbad): the ids of the rows this engine may meet, logged at start.
    allow_known_bad: list[str] = _key(_strings, [])

    @property
    def api_base(self) -> str:
        """Return the engine's OpenAI base URL (``api``, else the scheme, host and port of verify.url)."""
        return self.api or _origin(self.verify.url)


class ProfileKind(StrEnum):
    """What a profile's window brings up: an engine in a container, or nothing (the card handed over bare).

    The TOML, the status and the history say it as the plain string (``kind = "bare"``).
    """

    ENGINE = "engine"
    BARE = "bare"


DEFAULT_PROFILE = "default"
_PROFILE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What one kind of window brings up: ``[window]`` (the profile "default") or a ``[profiles.NAME]``.

    An engine profile has the same keys as ``[window]``; a bare one has no engine: the resident
    is cleared and the card handed to the caller once ``needs`` is free.
    """

    name: str
    kind: ProfileKind
    needs: int
    window: WindowConfig | None  # None for a bare profile

    @property
    def engine(self) -> WindowConfig:
        """Return the engine's configuration (only an engine profile has one)."""
        assert self.window is not None, f"profile {self.name} is bare: it has no engine"
        return self.window


def _listen(value: Any, path: str) -> str:
    text = _string(value, path).strip()
    if not text:
        return ""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or len(port) > 5:
        raise _fail(path, f"expected host:port such as \"127.0.0.1:9477\", got {text[:60]!r}")
    if not 1 <= int(port) <= 65535:
        raise _fail(path, f"port {port} is out of range (1..65535; 0 would pick a random port)")
    return text


def _command(value: Any, path: str) -> list[str]:
    argv = _strings(value, path)
    if argv and not os.path.isabs(argv[0]):
        raise _fail(f"{path}[0]", f"must be an absolute path, got {argv[0]!r}")
    return argv


def _event_names(value: Any, path: str) -> list[str]:
    names = _strings(value, path)
    for i, name in enumerate(names):
        if name not in KNOWN_EVENTS:
            raise _fail(f"{path}[{i}]", f"no event {name!r} (see the event names in gpuswapd.toml(5))")
    return names


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """``[metrics]``: Prometheus metrics, served over HTTP and/or written for node_exporter."""

    listen: str = _key(_listen, "")
    textfile: str = _key(_abs_path, "")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """``[gateway]``: gpuswapd-gateway, the one OpenAI-compatible address for every model on the card."""

    listen: str = _key(_listen, "127.0.0.1:8080")
    resident: str = _key(_base_url, "http://127.0.0.1:8090")
    idle: float = _key(_span(0.0), 300.0)
    hold: float = _key(_span(1.0), 900.0)
    on_resident_busy: str = _key(_choice("wait", "fail"), "wait")
    priority: int = _key(_int(-1000, 1000), 0)
    max_body: int = _key(_size, 32 * 1024**2)
    max_bodies: int = _key(_size, 128 * 1024**2)
    max_waiting: int = _key(_int(1, 65536), 256)
    loading_state: bool = _key(_bool, False)
    upstream_idle: float = _key(_span(1.0), 120.0)


@dataclass(frozen=True, kw_only=True)
class HooksConfig:
    """``[hooks]``: a command run for chosen events, never holding up the window."""

    command: list[str] = _key(_command, [])
    events: list[str] = _key(_event_names, ["window_failed", "degraded", "engine_restarted", "preempted",
                                            "recovered"])
    timeout: float = _key(_span(0.1), 10.0)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration."""

    daemon: DaemonConfig
    gpu: GpuConfig
    resident: ResidentConfig
    timers: TimersConfig
    window: WindowConfig
    metrics: MetricsConfig
    hooks: HooksConfig
    gateway: GatewayConfig
    profiles: dict[str, Profile] = field(default_factory=dict, compare=False)  # [profiles.NAME]; not "default"
    source: str = field(default="<defaults>", compare=False)
    gateway_configured: bool = field(default=False, compare=False)  # the file has a [gateway] table

    def profile(self, name: str) -> Profile:
        """Return a profile by name ("default" is ``[window]``); KeyError if there is none."""
        if name == DEFAULT_PROFILE:
            return Profile(name=DEFAULT_PROFILE, kind=ProfileKind.ENGINE, needs=self.gpu.window_needs,
                           window=self.window)
        return self.profiles[name]

    def all_profiles(self) -> list[Profile]:
        """List every profile, "default" first."""
        return [self.profile(DEFAULT_PROFILE), *(self.profiles[n] for n in sorted(self.profiles))]

    def engine_profiles(self) -> list[Profile]:
        """List the profiles that bring up an engine, "default" first."""
        return [p for p in self.all_profiles() if p.kind == ProfileKind.ENGINE]

    def idle_probe(self) -> IdleConfig:
        """Return ``[resident.idle]`` as the probe uses it: kind "gateway" asks the gateway's listen address."""
        idle = self.resident.idle
        if idle.kind != "gateway":
            return idle
        return dataclasses.replace(idle, url=f"http://{self.gateway.listen}{GATEWAY_IN_FLIGHT_PATH}")


GATEWAY_IN_FLIGHT_PATH = "/gpuswapd/in-flight"  # the gateway's answer to [resident.idle] kind = "gateway"


def _origin(url: str) -> str:
    """Return the scheme, host and port of an http(s) URL."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


class Problems:
    """Every error found in one configuration, each naming its key: the check goes on past each one.

    A key's parser raises a ConfigError ("KEY: why"); ``_build`` keeps it here and goes on with the
    next key, so a new key is reported with all the others without doing anything for it.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.found: list[str] = []
        self.absent: list[str] = []  # required keys the file leaves out

    def __len__(self) -> int:
        return len(self.found) + len(self.absent)

    def add(self, key: str, why: str) -> None:
        """Keep an error of ``key``."""
        self.found.append(f"{key}: {why}")

    def missing(self, key: str) -> None:
        """Keep a required key that the file leaves out."""
        self.absent.append(f"{key}: missing (this key has no default)")

    @contextlib.contextmanager
    def keep(self) -> Iterator[None]:
        """Run a block whose ConfigError is kept: it ends that block only."""
        try:
            yield
        except ConfigError as err:
            self.found.append(err.message)

    def raise_any(self) -> None:
        """Raise one ConfigError naming every error kept, one a line, each after the file's name."""
        if self.found or self.absent:
            raise ConfigError("\n".join(f"{self.source}: {line}" for line in [*self.absent, *self.found]))


# What a file that configures no resident is told (the shipped one, whose keys are all commented out).
NOT_CONFIGURED = ("not configured: gpuswapd hands the GPU from a resident model to an engine and back, and needs "
                  "both; set resident.units, resident.verify.url and resident.verify.model, and the engine's "
                  "[window] (health_url, container.name, container.image, verify.url, verify.model): the shipped "
                  "/etc/gpuswapd/gpuswapd.toml has a commented example, see gpuswapd.toml(5)")


def _build(cls: type[T], table: Any, path: str, problems: Problems) -> T | None:
    """Build a section dataclass from a TOML table; keep the error of every key (None if there was one)."""
    if not isinstance(table, dict):
        problems.add(path or "config", f"expected a table, got {type(table).__name__}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if f.name not in ("source", "profiles", "gateway_configured")}
    before = len(problems)
    for key in table:
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.add(_join(path, key), f"unknown key (known here: {known})")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        where = _join(path, name)
        if "parse" in f.metadata:
            if name in table:
                with problems.keep():
                    values[name] = f.metadata["parse"](table[name], where)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.missing(where)
        else:  # a sub-table
            values[name] = _build(_section_type(cls, name), table.get(name, {}), where, problems)
    return cls(**values) if len(problems) == before else None


def _section_type(cls: type[Any], name: str) -> type[Any]:
    section: type[Any] = typing.get_type_hints(cls)[name]
    return section


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def parse_config(text: str, source: str = "<string>") -> Config:
    """Parse and validate configuration text; a ConfigError names every error found, one a line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: not valid TOML: {err}") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise ConfigError(f"{source}: a value gpuswapd will not read: {err}") from None
    problems = Problems(source)
    tables = data.pop("profiles", {})
    config = _build(Config, data, "", problems)
    profiles = _profiles(config.gpu.window_needs if config else 0, tables, problems)
    if "resident" not in data:  # nothing configured: one line that says what to set, not each key it lacks
        problems.absent = [f"resident: {NOT_CONFIGURED}"]
    # Each key first; how keys relate is checked only once every key has a value it may have.
    problems.raise_any()
    assert config is not None
    config = dataclasses.replace(config, profiles=profiles, gateway_configured="gateway" in data)
    _check(config, problems)
    problems.raise_any()
    return dataclasses.replace(config, source=source)


def _profiles(window_needs: int, tables: Any, problems: Problems) -> dict[str, Profile]:
    """Build ``[profiles.NAME]`` ("default" is ``[window]``, not among them), keeping every error."""
    if not isinstance(tables, dict):
        problems.add("profiles", f"expected tables such as [profiles.bare], got {type(tables).__name__}")
        return {}
    out: dict[str, Profile] = {}
    for name, table in tables.items():
        with problems.keep():
            profile = _profile(name, table, window_needs, problems)
            if profile is not None:
                out[name] = profile
    return out


def _profile(name: str, table: Any, window_needs: int, problems: Problems) -> Profile | None:
    """Build one ``[profiles.NAME]``: a ConfigError for what ends it, ``problems`` for its keys."""
    path = f"profiles.{name}"
    if name == DEFAULT_PROFILE:
        raise _fail(path, "the name \"default\" is reserved for [window]")
    if not _PROFILE_NAME.match(name):
        raise _fail(path, "a profile name is lowercase letters, digits and '-', starting with a letter or digit")
    if not isinstance(table, dict):
        raise _fail(path, f"expected a table, got {type(table).__name__}")
    rest = dict(table)
    if "kind" not in rest:
        raise _fail(f"{path}.kind", "missing: \"engine\" (a container, the same keys as [window]) or \"bare\"")
    kind = ProfileKind(_choice(*(k.value for k in ProfileKind))(rest.pop("kind"), f"{path}.kind"))
    needs = window_needs
    if "needs" in rest:
        with problems.keep():
            needs = _size(rest.pop("needs"), f"{path}.needs")
    window = None
    if kind == ProfileKind.ENGINE:
        window = _build(WindowConfig, rest, path, problems)
        if window is None:
            return None
    elif rest:
        key = sorted(rest)[0]
        raise _fail(f"{path}.{key}", "unknown key (a bare profile knows only: kind, needs)")
    return Profile(name=name, kind=kind, needs=needs, window=window)


def _check(config: Config, problems: Problems) -> None:
    """Check what no single key can: how keys relate (every relation, each error kept)."""
    d, idle = config.daemon, config.resident.idle
    if d.default_lease > d.max_lease:
        problems.add("daemon.default_lease", "is longer than daemon.max_lease")
    if idle.kind == "command" and not idle.command:
        problems.add("resident.idle.command", "required when kind = \"command\"")
    if config.resident.server == "llama.cpp" and not config.resident.props_url:
        problems.add("resident.props_url", "required when resident.server = \"llama.cpp\": the llama-server's "
                     "own /props, not through a proxy (e.g. \"http://127.0.0.1:8081/props\", or llama-swap's "
                     "\"/upstream/MODEL/props\" when it starts the server); or set resident.server = \"other\" to "
                     "compare its models only")
    if not os.path.isabs(d.state_dir):
        problems.add("daemon.state_dir", "must be an absolute path")
    if d.priority_min_nonroot > d.priority_max_nonroot:
        problems.add("daemon.priority_min_nonroot", f"{d.priority_min_nonroot} is above "
                     f"daemon.priority_max_nonroot ({d.priority_max_nonroot})")
    if d.max_clients_per_uid > d.max_clients:
        problems.add("daemon.max_clients_per_uid", "is larger than daemon.max_clients")
    containers: dict[str, str] = {}
    ports: dict[tuple[str, int | None], tuple[str, bool]] = {}
    for p in config.all_profiles():
        where = "window" if p.name == DEFAULT_PROFILE else f"profiles.{p.name}"
        if p.kind == ProfileKind.BARE:
            if config.gpu.probe == "none":
                problems.add(where, "a bare profile needs a GPU probe (gpu.probe): only a reading of free VRAM "
                             "proves the card is clear before the lease is granted")
            continue
        name = p.engine.container.name
        if name in containers:
            problems.add(f"{where}.container.name", f"{name!r} is also the container of {containers[name]}: "
                         "each engine profile needs its own container")
        containers.setdefault(name, where)
        if p.engine.park.mode == "sleep" and config.gpu.probe == "none":
            problems.add(f"{where}.park.mode", "\"sleep\" needs a GPU probe (gpu.probe): only a reading of free "
                         "VRAM proves the resident fits beside a sleeping engine")
        # A parked engine keeps listening: another profile's engine could not take its port.
        url = urllib.parse.urlsplit(p.engine.health_url)
        port = (url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
        parks = p.engine.park.mode == "sleep"
        if port in ports and (parks or ports[port][1]):
            other, _ = ports[port]
            problems.add(f"{where}.health_url", f"port {port[1]} of {port[0]} is also {other}'s, and with "
                         "park.mode = \"sleep\" a parked engine keeps it while the other boots: give each engine "
                         "profile its own port")
        ports.setdefault(port, (where, parks))
    _check_metrics(config.metrics, problems)
    _check_hooks(config.hooks, problems)
    _check_serves(config, problems)
    _check_gateway_bypass(config, problems)


def _check_serves(config: Config, problems: Problems) -> None:
    """Refuse a model name that two tenants serve: the gateway could not route it."""
    owner: dict[str, str] = {config.resident.verify.model: "the resident (resident.verify.model)"}
    for p in config.engine_profiles():
        where = "window.serves" if p.name == DEFAULT_PROFILE else f"profiles.{p.name}.serves"
        for name in p.engine.serves:
            if name in owner:
                problems.add(where, f"{name!r} is also served by {owner[name]}: a model name opens one tenant "
                             "only (rename it, or serve it from one place)")
            owner.setdefault(name, f"{where} (profile {p.name!r})")


def _check_gateway_bypass(config: Config, problems: Problems) -> None:
    """Refuse resident probes that go through the gateway: RESTORING would wait on a window that waits on it."""
    if not config.gateway_configured:
        return
    listen = _host_port(f"http://{config.gateway.listen}")
    checks = [("resident.verify.url", config.resident.verify.url)]
    if config.resident.props_url:
        checks.append(("resident.props_url", config.resident.props_url))
    if config.resident.idle.kind in ("llama.cpp-slots", "prometheus"):
        checks.append(("resident.idle.url", config.resident.idle.url))
    for key, url in checks:
        if _host_port(url) == listen:
            problems.add(key, f"{url!r} is the gateway's own address (gateway.listen = {config.gateway.listen!r}): "
                         "the resident's probes must bypass the gateway; point them at llama-swap or the resident "
                         f"directly (gateway.resident = {config.gateway.resident!r})")


def _host_port(url: str) -> tuple[str, int]:
    """Return the host and port an http(s) URL connects to (localhost counts as 127.0.0.1)."""
    scheme, _, rest = url.partition("://")
    netloc = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    host, sep, port = netloc.rpartition(":")
    if not sep or not port.isdigit() or "]" in port:
        host, port = netloc, "443" if scheme == "https" else "80"
    host = host.strip("[]").lower()
    return ("127.0.0.1" if host in ("localhost", "") else host), int(port)


def _check_metrics(metrics: MetricsConfig, problems: Problems) -> None:
    """Refuse a textfile gpuswapd could not write: its directory must exist and be writable."""
    if not metrics.textfile:
        return
    target = Path(metrics.textfile)
    if not target.name.endswith(".prom"):
        problems.add("metrics.textfile", f"node_exporter reads only files ending in .prom: {metrics.textfile!r}")
    elif not target.parent.is_dir():
        problems.add("metrics.textfile", f"no directory {str(target.parent)!r} (create it, and let gpuswapd write "
                     "there: ReadWritePaths= in a drop-in, see gpuswapd.toml(5))")
    elif not os.access(target.parent, os.W_OK | os.X_OK):
        problems.add("metrics.textfile", f"{str(target.parent)!r} is not writable by gpuswapd (read-only under "
                     "ProtectSystem=strict without ReadWritePaths=, or owned by another user: gpuswapd runs as root "
                     "without CAP_DAC_OVERRIDE)")


def _check_hooks(hooks: HooksConfig, problems: Problems) -> None:
    """Refuse a hook command that is not an executable file."""
    if not hooks.command:
        return
    program = hooks.command[0]
    if not os.path.isfile(program) or not os.access(program, os.X_OK):
        problems.add("hooks.command[0]", f"{program!r} is not an executable file")


def warnings(config: Config) -> list[str]:
    """Say what is valid but probably not what was meant (``--check-config`` prints these)."""
    out = []
    for p in config.engine_profiles():
        where = "window" if p.name == DEFAULT_PROFILE else f"profiles.{p.name}"
        c, park = p.engine.container, p.engine.park
        if park.mode != "sleep":
            continue
        if "--enable-sleep-mode" not in c.command:
            out.append(f"{where}.park.mode = \"sleep\", but {where}.container.command has no --enable-sleep-mode: "
                       "vLLM offers sleep only when started with it (an env_file or the image may still set it)")
        if c.env.get("VLLM_SERVER_DEV_MODE") != "1":
            out.append(f"{where}.park.mode = \"sleep\", but {where}.container.env has no VLLM_SERVER_DEV_MODE = "
                       "\"1\": vLLM serves /sleep and /wake_up only with it "
                       "(an env_file or the image may still set it)")
    return out


def gateway_problems(config: Config) -> list[str]:
    """Say what leaves gpuswapd-gateway nothing to do: no ``[gateway]`` table, no model name any window serves."""
    out = []
    if not config.gateway_configured:
        out.append("gateway: missing: gpuswapd-gateway is configured by the [gateway] table (listen, resident, "
                   "...); add it, see gpuswapd.toml(5)")
    if not any(p.engine.serves for p in config.engine_profiles()):
        out.append("window.serves: no engine profile serves a model name (window.serves, profiles.NAME.serves): "
                   "every request would go to the resident and no window would ever open; name the models each "
                   "engine answers to")
    return out


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate the configuration file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    return parse_config(text, str(path))
