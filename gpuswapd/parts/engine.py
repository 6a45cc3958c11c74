"""The engine that owns the GPU during a window: a container, or none at all for a bare profile.

Every profile's engine is watched, taken down and asked for its processes (``Engine``). Only an
engine profile's, a Docker container started and stopped (``ContainerEngine``), is asked to come
up and to prove it serves; a bare profile's (``BareEngine``) has nothing to boot.

With ``window.park.mode = "sleep"`` a container may also be put to sleep (vLLM's sleep mode:
weights to host RAM or dropped, most of the GPU freed) and woken for the next window; a short
greedy completion, the canary, proves a woken engine answers as it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from gpuswapd import clock
from gpuswapd.adapters.docker import Docker, read_env_file
from gpuswapd.adapters.openai import ModelHttp
from gpuswapd.config import WindowConfig
from gpuswapd.errors import (
    ContainerNotFound,
    DockerError,
    EndpointError,
    EngineFailed,
    GpuswapError,
    ImageNotFound,
    WindowError,
)
from gpuswapd.instances import DEFAULT_INSTANCE
from gpuswapd.logs import log
from gpuswapd.outside import Outside
from gpuswapd.parts import engineview
from gpuswapd.parts.engineview import EngineView
from gpuswapd.record import ContainerHandle
from gpuswapd.retry import backoff
from gpuswapd.tasks import in_daemon_thread, reap, sleep_unless, spawn

R = TypeVar("R")
MANAGED_LABEL = "io.gpuswapd.managed"
INSTANCE_LABEL = "io.gpuswapd.instance"
WINDOW_LABEL = "io.gpuswapd.window"
WATCH_WAIT_S = 300.0
WATCH_RETRY_S = (1.0, 30.0)
HEALTH_S = 2.0  # one health probe; a slower answer counts as a miss
PIDS_S = 10.0  # `docker top` of the engine (best effort: its pids unknown, the fit checks are unsure)
# The canary: short and greedy. A long greedy output may drift on a GPU (vLLM's kernels are not
# batch-invariant by default); a garbled wake is garbage from the first tokens.
CANARY_PROMPT = "List the first five prime numbers, separated by commas."
CANARY_TOKENS = 16
CANARY_SAMPLING = {"temperature": 0, "seed": 0}


class Engine(Protocol):
    """What a window asks of its profile's engine, whatever the profile's kind.

    An engine profile's is a ``ContainerEngine``, which also boots, warms, sleeps and wakes
    (the window asks that only of an engine window's: ``Window.container_engine``); a bare
    profile's is a ``BareEngine``, which has nothing to start, watch or take down.
    """

    async def preflight(self, check_port: bool = True) -> None:
        """Check, changing nothing, that the engine could come up now (its port too, unless told not to)."""

    async def adopt(self, record: ContainerHandle) -> bool:
        """Take over an engine an earlier gpuswapd started; tell whether it still serves."""

    async def watch(self, interval: float) -> str:
        """Return why the engine failed, as soon as it does."""

    async def take_down(self, record: ContainerHandle | None) -> None:
        """Stop the engine and free the GPU (removing what bring_up created)."""

    async def pids(self) -> list[int]:
        """List the host pids of the engine's processes (empty if it does not run or nobody can say)."""

    async def remove_orphans(self, keep: set[str]) -> list[str]:
        """Remove this instance's engines that belong to no window in ``keep``."""

    async def orphaned(self, keep: set[str]) -> list[str]:
        """Name the windows of this instance's running engines that belong to no window in ``keep``."""

    async def why_not_parked(self, record: ContainerHandle) -> str | None:
        """Say why a parked engine cannot be used (gone, awake, another spec); None if it can."""

    async def settings(self, ask_docker: bool = True) -> EngineView | None:
        """Say what the engine's container runs with (None: there is no container)."""


class ContainerEngine:
    """An engine in a Docker container, created or started per window."""

    def __init__(self, config: WindowConfig, docker: Docker, http: ModelHttp, outside: Outside,
                 instance: str = DEFAULT_INSTANCE) -> None:
        self.config = config
        self.docker = docker
        self.http = http
        self.outside = outside
        self.instance = instance
        self._exit: str | None = None
        self._exited = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        """Return the container's name."""
        return self.config.container.name

    async def _docker(self, name: str, func: Callable[..., R], *args: Any, deadline: float | None = None) -> R:
        lane = self.outside.docker
        return await lane.call_within(deadline or lane.deadline, name, func, *args)

    async def preflight(self, check_port: bool = True) -> None:
        """Check Docker, the image or container, the env file, and that the engine's port is free."""
        c = self.config.container
        await self._docker("ping", self.docker.ping)
        if c.env_file:
            await self._docker("env_file", read_env_file, c.env_file)
        if c.create:
            if not await self._docker("image_present", self.docker.image_present, c.image):
                raise ImageNotFound(f"image {c.image!r} is not in Docker: `docker pull {c.image}` or `docker load` it")
            state = await self._docker("state", self.docker.state, c.name)
            if state is not None and not self._ours(state.labels):
                raise DockerError(f"a container named {c.name!r} exists and was not made by this gpuswapd: "
                                  f"remove it (`docker rm -f {c.name}`) or set window.container.create = false")
            if state is not None and state.running:
                raise DockerError(f"container {c.name!r} is already running: stop it first (`docker stop {c.name}`)")
        else:
            state = await self._docker("state", self.docker.state, c.name)
            if state is None:
                raise ContainerNotFound(f"no container named {c.name!r} (window.container.create = false)")
            if state.running:
                raise DockerError(f"container {c.name!r} is already running: stop it first (`docker stop {c.name}`)")
        port = self._port() if check_port else None
        if port is not None and await _port_taken(port):
            raise WindowError(f"port {port} of {self.config.health_url} is already in use by something "
                              f"else: `ss -ltnp 'sport = :{port}'` shows what")

    def _ours(self, labels: dict[str, str]) -> bool:
        """Tell whether gpuswapd made this container, for this instance (0.1 set no instance label)."""
        return labels.get(MANAGED_LABEL) == "1" and labels.get(INSTANCE_LABEL, DEFAULT_INSTANCE) == self.instance

    def _port(self) -> int | None:
        parts = urlsplit(self.config.health_url)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
        return parts.port or (443 if parts.scheme == "https" else 80)

    async def bring_up(self, window_id: str) -> ContainerHandle:
        """Create (or find) and start the container; watch it for an early exit."""
        c = self.config.container
        self._exit = None
        self._exited.clear()
        if c.create:
            stale = await self._docker("state", self.docker.state, c.name)
            if stale is not None:  # one of ours, left by an earlier window (checked in preflight)
                await self._docker("remove", self.docker.remove, c.name)
            labels = {MANAGED_LABEL: "1", INSTANCE_LABEL: self.instance, WINDOW_LABEL: window_id}
            await self._docker("create", self.docker.create, c, labels)
        started = await self._docker("start", self.docker.start, c.name)
        self._watch_exits()
        log.info("engine_started", container=c.name, image=c.image, created=c.create)
        return ContainerHandle(name=c.name, created=c.create, image=c.image, window=window_id, spec=self.spec(),
                               started=started or None)

    async def settings(self, ask_docker: bool = True) -> EngineView:
        """Say what the container runs with: as Docker has it where it answers, else as configured."""
        c = self.config.container
        file_env: dict[str, str] = {}
        try:
            if c.env_file:
                file_env = await self._docker("env_file", read_env_file, c.env_file)
            view = engineview.from_config(c, file_env)
            if not ask_docker:
                return view
            if c.create:
                image = await self._docker("settings", self.docker.image_settings, c.image)
                return view if image is None else engineview.under_image(view, image)
            container = await self._docker("settings", self.docker.container_settings, c.name)
            return view if container is None else engineview.from_container(view, container)
        except GpuswapError:  # Docker is down or the env file unreadable: preflight says so
            return engineview.from_config(c, file_env)

    def spec(self) -> str:
        """Return a hash of the container's configuration (a parked engine must match it)."""
        c = dataclasses.asdict(self.config.container)
        text = json.dumps({"container": c, "health_url": self.config.health_url}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def base_url(self) -> str:
        """Return the engine's base URL (sleep mode's endpoints live there), from ``health_url``."""
        parts = urlsplit(self.config.health_url)
        return f"{parts.scheme}://{parts.netloc}"

    async def offers_sleep(self) -> bool:
        """Tell whether the engine serves ``/is_sleeping`` (vLLM with sleep mode and dev mode on)."""
        http = self.outside.http
        try:
            sleeping = await http.run("is_sleeping", self.http.is_sleeping(self.base_url, HEALTH_S),
                                      http.beyond(HEALTH_S))
        except EndpointError as err:
            log.warning("engine_sleep_unavailable", reason=err.message)
            return False
        if sleeping is None:
            log.warning("engine_sleep_unavailable",
                        reason=f"{self.base_url}/is_sleeping is not served: start vLLM with --enable-sleep-mode "
                               "and VLLM_SERVER_DEV_MODE=1; windows end with the engine removed "
                               "(window.park.mode = \"stop\") until then")
            return False
        return True

    async def sleep(self, level: int) -> None:
        """Put the engine to sleep at ``level``; wait until ``/is_sleeping`` says so."""
        await reap(self._watch)  # a parked engine is watched by the window, not by the exit watcher
        self._watch = None
        http, limit = self.outside.http, self.config.boot_timeout
        try:
            await http.run("sleep", self.http.sleep(self.base_url, level, limit), http.beyond(limit))
            await self._until_sleeping(True, limit)
        except EndpointError as err:
            raise EngineFailed(f"the engine did not go to sleep: {err.message}") from err

    async def wake(self) -> None:
        """Wake the engine; wait until ``/is_sleeping`` says it is awake; watch it again."""
        http, limit = self.outside.http, self.config.boot_timeout
        try:
            await http.run("wake_up", self.http.wake_up(self.base_url, limit), http.beyond(limit))
            await self._until_sleeping(False, limit)
        except EndpointError as err:
            raise EngineFailed(f"the parked engine did not wake: {err.message}") from err
        self._watch_exits()

    async def _until_sleeping(self, want: bool, limit: float) -> None:
        deadline = clock.monotonic() + limit
        http = self.outside.http
        while True:
            said = await http.run("is_sleeping", self.http.is_sleeping(self.base_url, HEALTH_S),
                                  http.beyond(HEALTH_S))
            if said is None:
                raise EndpointError(f"{self.base_url}/is_sleeping is not served any more")
            if said is want:
                return
            if clock.monotonic() >= deadline:
                raise EndpointError(f"{self.base_url}/is_sleeping still says {str(said).lower()} after {limit:g}s")
            await asyncio.sleep(0.05)

    async def canary(self) -> str:
        """Send the short greedy canary completion; return reasoning and answer as they came."""
        check, http = self.config.verify, self.outside.http
        try:
            reply = await http.run("canary", self.http.chat(check.url, check.model, CANARY_PROMPT, CANARY_TOKENS,
                                                            check.timeout, sampling=CANARY_SAMPLING),
                                   http.beyond(check.timeout))
        except EndpointError as err:
            raise EngineFailed(f"the engine did not answer the canary: {err.message}") from err
        return reply.reasoning + reply.text

    async def why_not_parked(self, record: ContainerHandle) -> str | None:
        """Say why a parked engine cannot be used: gone, not ours, another spec, awake; None if usable."""
        if record.spec != self.spec():
            return "the container's configuration changed since it was parked"
        try:
            state = await self._docker("state", self.docker.state, self.name)
        except GpuswapError as err:
            # Docker being away is no failure of the engine: its own answer decides (as in adopt).
            log.warning("parked_engine_without_docker", container=self.name, error=err.message)
            state = None
        else:
            if state is None or not state.running:
                return f"container {self.name} is {'gone' if state is None else state.status}"
        if state is not None and (not self._ours(state.labels)
                                  or state.labels.get(WINDOW_LABEL) != record.window):
            return f"container {self.name} is not the engine that was parked"
        http = self.outside.http
        try:
            sleeping = await http.run("is_sleeping", self.http.is_sleeping(self.base_url, HEALTH_S),
                                      http.beyond(HEALTH_S))
        except EndpointError as err:
            return f"it does not answer: {err.message}"
        if sleeping is not True:
            return "it says it is not sleeping" if sleeping is False else "it does not serve /is_sleeping"
        return None

    def _watch_exits(self) -> None:
        self._exit = None
        self._exited.clear()
        self._watch = spawn(self._watch_exit(), "engine-exit-watch")

    async def _watch_exit(self) -> None:
        """Wait for the container to exit; Docker being away is no exit (health still watches)."""
        failures = 0
        while True:
            try:
                state = await in_daemon_thread(self.docker.wait_exit, self.name, WATCH_WAIT_S, name="engine-watch")
            except ContainerNotFound:
                self._exited_because(f"container {self.name} was removed behind gpuswapd's back")
                return
            except DockerError as err:
                failures += 1
                delay = backoff(WATCH_RETRY_S, failures)
                log.warning("engine_watch_lost", container=self.name, error=err.message, retry_in_s=delay)
                await asyncio.sleep(delay)
                continue
            if state is not None:
                try:
                    tail = (await self._docker("logs_tail", self.docker.logs_tail, self.name, 5)).strip().splitlines()
                except GpuswapError as err:
                    tail = [f"(its log could not be read: {err.message})"]
                last = f": {tail[-1].strip()}" if tail else ""
                self._exited_because(f"container {self.name} exited with code {state.exit_code}{last}")
                return
            failures = 0

    def _exited_because(self, reason: str) -> None:
        self._exit = reason
        log.warning("engine_exited", container=self.name, reason=reason)
        self._exited.set()

    def exit_reason(self) -> str | None:
        """Say why the container stopped, if it has."""
        return self._exit

    async def adopt(self, record: ContainerHandle) -> bool:
        """Watch a container an earlier gpuswapd started, if it runs and answers.

        The window's READY was written after a completion from the start ``record`` names. Where
        Docker says the container runs that same start, health decides; where it was started again
        since (a restart whose record was never written) or nobody can say (Docker unreachable or
        hung: the exit watcher keeps trying it; an older document), the engine must answer the
        verifying completion first.
        """
        why: str | None = None
        try:
            state = await self._docker("state", self.docker.state, self.name)
        except GpuswapError as err:
            log.warning("adopt_without_docker", container=self.name, error=err.message)
            why = f"Docker did not say which start runs: {err.message}"
        else:
            if state is None or not state.running:
                return False
            if not record.started or state.started_at != record.started:
                why = ("the window recorded no start of it" if not record.started else
                       f"it was started again ({state.started_at or 'at a time Docker does not say'}) "
                       f"after the window verified the start of {record.started}")
        self._watch_exits()
        if not await self.healthy():
            return False
        if why is None:
            return True
        try:
            await self._verify()
        except EngineFailed as err:
            log.warning("engine_unverified_on_adoption", container=self.name, why=why, error=err.message)
            return False
        log.info("engine_verified_on_adoption", container=self.name, why=why)
        return True

    async def remove_orphans(self, keep: set[str]) -> list[str]:
        """Stop and remove this instance's containers that belong to no window in ``keep``."""
        gone = []
        for state in await self._docker("find", self.docker.find, {MANAGED_LABEL: "1"}):
            if not self._ours(state.labels):
                continue  # another instance's (or another gpuswapd's) engine
            if state.labels.get(WINDOW_LABEL) in keep:
                continue
            log.warning("orphan_engine_removed", container=state.name, window=state.labels.get(WINDOW_LABEL),
                        status=state.status)
            await self._remove(state.name)
            gone.append(state.name)
        return gone

    async def orphaned(self, keep: set[str]) -> list[str]:
        """Name the windows of this instance's running containers that belong to no window in ``keep``."""
        return [str(state.labels.get(WINDOW_LABEL)) for state in await self._docker("find", self.docker.find,
                                                                                     {MANAGED_LABEL: "1"})
                if self._ours(state.labels) and state.running and state.labels.get(WINDOW_LABEL)
                and state.labels.get(WINDOW_LABEL) not in keep]

    async def wait_serving(self, timeout: float) -> float:
        """Poll health until 200 within ``timeout``; a container that exits fails at once."""
        try:
            return await self.outside.http.run(
                "wait_healthy", self.http.wait_healthy(self.config.health_url, timeout, interval=0.05,
                                                       abort=self.exit_reason), self.outside.http.beyond(timeout))
        except EndpointError as err:
            raise EngineFailed(err.message) from err

    async def watch(self, interval: float) -> str:
        """Return why the engine failed: its container exited, or health failed (503/500 at once)."""
        misses = 0
        while True:
            if self._exited.is_set() or self._watch is None:
                return self._exit or f"container {self.name} is not being watched"
            if await sleep_unless(self._exited, interval):
                continue
            try:
                status = await self.outside.http.run("health", self.http.health(self.config.health_url, HEALTH_S),
                                                 self.outside.http.beyond(HEALTH_S))
            except EndpointError as err:
                status, detail = 0, err.message
            else:
                detail = f"HTTP {status}" if status else "nothing answers"
            # EngineDeadError answers 503 (or 500) at once; a slow answer may just be load.
            misses = 0 if status == 200 else misses + (2 if status in (500, 503) else 1)
            if misses >= 2:
                return f"{self.config.health_url} failed: {detail}"

    async def warm(self) -> None:
        """Send the warmup completions, then the verifying one that must be answered."""
        w, check, http = self.config.warmup, self.config.verify, self.outside.http
        try:
            for n in range(w.requests):
                # A cold engine compiles kernels on its first requests: these run before READY.
                reply = await http.run("chat", self.http.chat(check.url, check.model, w.prompt, w.max_tokens,
                                                              check.timeout), http.beyond(check.timeout))
                log.info("engine_warmup", request=n + 1, of=w.requests,
                         completion_tokens=reply.completion_tokens, took_s=round(reply.total_s, 3))
        except EndpointError as err:
            raise EngineFailed(f"the engine did not answer a completion: {err.message}") from err
        await self._verify()

    async def _verify(self) -> None:
        """Send the verifying completion, which must be answered."""
        check, http = self.config.verify, self.outside.http
        try:
            reply = await http.run("verify", self.http.verify(check), http.beyond(check.timeout))
        except EndpointError as err:
            raise EngineFailed(f"the engine did not answer a completion: {err.message}") from err
        log.info("engine_verified", completion_tokens=reply.completion_tokens, took_s=round(reply.total_s, 3))

    async def healthy(self) -> bool:
        """Tell whether health answers 200 now (any failure to answer is "no")."""
        try:
            status = await self.outside.http.run("health", self.http.health(self.config.health_url, HEALTH_S),
                                                 self.outside.http.beyond(HEALTH_S))
        except GpuswapError as err:
            log.info("engine_health_unanswered", error=err.message)
            return False
        return status == 200 and self._exit is None

    async def pids(self) -> list[int]:
        """List the host pids of the container's processes (``docker top``): the card lists them."""
        try:
            # Best effort, within PIDS_S: unknown pids only make the fit checks unsure, while a wait of
            # Docker's full deadline would hold the window (its leases' expiry among it) that long.
            return await self._docker("top", self.docker.top, self.name,
                                      deadline=min(PIDS_S, self.outside.docker.deadline))
        except GpuswapError as err:
            log.warning("engine_pids_unknown", container=self.name, error=err.message,
                        consequence="its memory on the card counts as another process's until it is free")
            return []

    async def take_down(self, record: ContainerHandle | None) -> None:
        """Stop the container (SIGTERM, then SIGKILL after stop_timeout) and remove it if created."""
        await reap(self._watch)
        self._watch = None
        c = self.config.container
        if record is None or (c.create if record.created is None else record.created):
            await self._remove(c.name)
        else:
            await self._docker("stop", self.docker.stop, c.name, c.stop_timeout,
                               deadline=c.stop_timeout + self.outside.docker.deadline)
        log.info("engine_stopped", container=c.name)

    async def _remove(self, name: str) -> None:
        c = self.config.container
        await self._docker("stop", self.docker.stop, name, c.stop_timeout,
                           deadline=c.stop_timeout + self.outside.docker.deadline)
        await self._docker("remove", self.docker.remove, name)


class BareEngine:
    """No engine at all: a bare window hands the cleared card to its lease holders.

    Watching it waits for ever (the holders' own processes are theirs to watch), and there is
    nothing to take down; it boots, wakes and parks nothing, so it has no such methods.
    """

    async def preflight(self, check_port: bool = True) -> None:
        """Nothing to check: no container, no port."""

    async def adopt(self, record: ContainerHandle) -> bool:
        """Take over a bare window: its holders still hold the card."""
        return True

    async def watch(self, interval: float) -> str:
        """Wait for ever: a bare window's holders run their own processes."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def take_down(self, record: ContainerHandle | None) -> None:
        """Nothing to take down."""

    async def pids(self) -> list[int]:
        """List nothing: the holders' processes are their own."""
        return []

    async def remove_orphans(self, keep: set[str]) -> list[str]:
        """Nothing of a bare window's is left in Docker."""
        return []

    async def orphaned(self, keep: set[str]) -> list[str]:
        """Name nothing: a bare window leaves nothing in Docker."""
        return []

    async def why_not_parked(self, record: ContainerHandle) -> str | None:
        """Say why nothing of a bare window is ever parked."""
        return "a bare window has no engine"

    async def settings(self, ask_docker: bool = True) -> EngineView | None:
        """Say nothing: there is no container."""
        return None


async def _port_taken(port: int) -> bool:
    """Tell whether something listens on the local port."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 0.5)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
