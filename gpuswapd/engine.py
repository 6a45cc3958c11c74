"""The engine that owns the GPU during a window, behind one interface.

The window only asks an engine to come up, to prove it serves, and to go down. Today that is
a Docker container started and stopped; vLLM's sleep mode (weights to CPU RAM, GPU freed) can
later implement the same interface without touching the phase table.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

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
from gpuswapd.logs import log
from gpuswapd.outside import Outside
from gpuswapd.tasks import reap, sleep_unless, spawn

R = TypeVar("R")
MANAGED_LABEL = "io.gpuswapd.managed"
INSTANCE_LABEL = "io.gpuswapd.instance"
WINDOW_LABEL = "io.gpuswapd.window"
DEFAULT_INSTANCE = "default"
WATCH_WAIT_S = 300.0
WATCH_RETRY_S = (1.0, 30.0)
HEALTH_S = 2.0  # one health probe; a slower answer counts as a miss


class Engine(Protocol):
    """What a window needs of its engine."""

    async def preflight(self) -> None:
        """Check, changing nothing, that the engine could come up now."""

    async def bring_up(self, window_id: str) -> dict[str, Any]:
        """Start the engine; return what must be recorded to take it down later."""

    async def wait_serving(self, timeout: float) -> float:
        """Wait until the engine answers health checks; fail early if it dies."""

    async def warm(self) -> None:
        """Warm a freshly booted engine and prove it answers a completion."""

    async def healthy(self) -> bool:
        """Tell whether the engine answers its health check now."""

    def exit_reason(self) -> str | None:
        """Say why the engine stopped, if it has."""

    async def adopt(self, record: dict[str, Any]) -> bool:
        """Take over an engine an earlier gpuswapd started; tell whether it still serves."""

    async def watch(self, interval: float) -> str:
        """Return why the engine failed, as soon as it does."""

    async def take_down(self, record: dict[str, Any] | None) -> None:
        """Stop the engine and free the GPU (removing what bring_up created)."""

    async def remove_orphans(self, keep_window: str | None) -> list[str]:
        """Remove this instance's engines that no window record knows."""


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

    async def preflight(self) -> None:
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
        port = self._port()
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

    async def bring_up(self, window_id: str) -> dict[str, Any]:
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
        await self._docker("start", self.docker.start, c.name)
        self._watch_exits()
        log.info("engine_started", container=c.name, image=c.image, created=c.create)
        return {"name": c.name, "created": c.create, "image": c.image}

    def _watch_exits(self) -> None:
        self._exit = None
        self._exited.clear()
        self._watch = spawn(self._watch_exit(), "engine-exit-watch")

    async def _watch_exit(self) -> None:
        """Wait for the container to exit; Docker being away is no exit (health still watches)."""
        delay = WATCH_RETRY_S[0]
        while True:
            try:
                state = await _in_daemon_thread(self.docker.wait_exit, self.name, WATCH_WAIT_S)
            except ContainerNotFound:
                self._exited_because(f"container {self.name} was removed behind gpuswapd's back")
                return
            except DockerError as err:
                log.warning("engine_watch_lost", container=self.name, error=err.message, retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, WATCH_RETRY_S[1])
                continue
            if state is not None:
                try:
                    tail = (await self._docker("logs_tail", self.docker.logs_tail, self.name, 5)).strip().splitlines()
                except GpuswapError as err:
                    tail = [f"(its log could not be read: {err.message})"]
                last = f": {tail[-1].strip()}" if tail else ""
                self._exited_because(f"container {self.name} exited with code {state.exit_code}{last}")
                return
            delay = WATCH_RETRY_S[0]

    def _exited_because(self, reason: str) -> None:
        self._exit = reason
        log.warning("engine_exited", container=self.name, reason=reason)
        self._exited.set()

    def exit_reason(self) -> str | None:
        """Say why the container stopped, if it has."""
        return self._exit

    async def adopt(self, record: dict[str, Any]) -> bool:
        """Watch a container an earlier gpuswapd started, if it runs and answers health.

        Docker may be unreachable or hung meanwhile: then health alone decides, and the exit
        watcher keeps trying Docker.
        """
        try:
            state = await self._docker("state", self.docker.state, self.name)
        except GpuswapError as err:
            log.warning("adopt_without_docker", container=self.name, error=err.message)
        else:
            if state is None or not state.running:
                return False
        self._watch_exits()
        return await self.healthy()

    async def remove_orphans(self, keep_window: str | None) -> list[str]:
        """Stop and remove this instance's containers that belong to no window gpuswapd knows."""
        gone = []
        for state in await self._docker("find", self.docker.find, {MANAGED_LABEL: "1"}):
            if not self._ours(state.labels):
                continue  # another instance's (or another gpuswapd's) engine
            if keep_window is not None and state.labels.get(WINDOW_LABEL) == keep_window:
                continue
            log.warning("orphan_engine_removed", container=state.name, window=state.labels.get(WINDOW_LABEL),
                        status=state.status)
            await self._remove(state.name)
            gone.append(state.name)
        return gone

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

    async def take_down(self, record: dict[str, Any] | None) -> None:
        """Stop the container (SIGTERM, then SIGKILL after stop_timeout) and remove it if created."""
        await reap(self._watch)
        self._watch = None
        c = self.config.container
        if record is None or record.get("created", c.create):
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


def _in_daemon_thread(func: Callable[..., R], *args: Any) -> asyncio.Future[R]:
    """Run a long blocking wait on a daemon thread of its own.

    A long wait (the container's exit) must neither hold a worker of the shared pool nor keep
    gpuswapd from exiting when it leaves the engine running (on_shutdown = "keep").
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[R] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = func(*args), None
        except BaseException as err:
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the loop is gone: gpuswapd is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="engine-watch", daemon=True).start()
    return future


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
