"""The gpuswapd daemon: startup, serve, graceful shutdown (systemd's SIGTERM restores the resident)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuswapd import __version__, clock, failpoints, instances, naps
from gpuswapd.adapters.docker import Docker
from gpuswapd.adapters.gpu import GpuProbe, make_probe
from gpuswapd.adapters.openai import ModelHttp
from gpuswapd.adapters.pagecache import Files, PageCache
from gpuswapd.adapters.slots import SlotFiles
from gpuswapd.adapters.systemd import Systemd
from gpuswapd.checks import bootchecks, knownbad
from gpuswapd.checks.machine import check_machine
from gpuswapd.config import DEFAULT_PATH, DEFAULT_PROFILE, Config, load_config
from gpuswapd.config import warnings as config_warnings
from gpuswapd.errors import ConfigError, DockerUnavailable, GpuswapError
from gpuswapd.events import EventBus
from gpuswapd.instances import DEFAULT_INSTANCE
from gpuswapd.logs import log, setup_logging
from gpuswapd.notify import Notifier
from gpuswapd.observe.observers import Observers
from gpuswapd.outside import Deadlines, Outside
from gpuswapd.parts.engine import ContainerEngine, Engine
from gpuswapd.parts.resident import Resident
from gpuswapd.parts.vram import Vram
from gpuswapd.server.listen import activation_socket, own_socket, raise_fd_limit
from gpuswapd.server.peers import Host
from gpuswapd.server.server import Server
from gpuswapd.state.marks import Marks, marks_dir, memory_marks
from gpuswapd.state.store import StateStore
from gpuswapd.tasks import reap, sleep_unless, spawn
from gpuswapd.window import identity
from gpuswapd.window.plan import make_plan
from gpuswapd.window.recovery import recover_at_start
from gpuswapd.window.window import Window

EX_CONFIG = 78  # sysexits.h; the unit sets RestartPreventExitStatus=78
# The shutdown must end within the units' TimeoutStopSec= (11min), or systemd kills gpuswapd in the
# middle of it: the close may take SHUTDOWN_BOUND_S from the signal, then the window
# SHUTDOWN_ABORT_S to stop where it is, then the last write WRITER_STOP_S (a test checks the units
# against these).
SHUTDOWN_BOUND_S = 600.0
WRITER_STOP_S = 10.0


@dataclass
class Systems:
    """The outside systems one gpuswapd talks to (the simulation hands in fakes of each)."""

    systemd: Systemd
    docker: Docker
    http: ModelHttp
    probe: GpuProbe | None
    store: StateStore
    host: Host | None = None  # what the OS says of callers; None: the real one (LinuxHost over systemd)
    files: Files | None = None  # the page cache of the resident's model files (None: the machine's own)
    marks: Marks | None = None  # what gpuswapd stopped (None: beside the socket, or in memory for fakes)
    slot_files: SlotFiles | None = None  # the resident's slot save directory (None: the machine's own)

    @classmethod
    def real(cls, config: Config) -> Systems:
        """Connect the real adapters of this configuration (nothing is called yet)."""
        d = config.daemon
        return cls(Systemd(call_timeout=d.call_timeout), Docker(timeout=d.call_timeout), ModelHttp(),
                   make_probe(config.gpu), StateStore(d.state_dir), files=PageCache())


class Daemon:
    """One gpuswapd process: the adapters, the window and the socket server."""

    def __init__(self, config: Config, bus: EventBus | None = None, instance: str = DEFAULT_INSTANCE,
                 systems: Systems | None = None, known_bad: knownbad.Table | None = None) -> None:
        self.config = config
        self.instance = instance
        self.known_bad = known_bad  # None: read at start
        self.notifier = Notifier()
        d = config.daemon
        # Each adapter bounds its own calls a little below its lane's deadline: the adapter's
        # error, which says what happened, usually comes first.
        self.outside = Outside(Deadlines(systemd=d.call_timeout + 5.0, docker=d.call_timeout + 5.0,
                                         state=d.call_timeout, gpu=config.gpu.probe_timeout + 2.0,
                                         files=d.call_timeout))
        real = systems is None
        systems = systems or Systems.real(config)
        # What gpuswapd stopped, kept beside its socket (/run/gpuswapd/NAME.stopped: a reboot clears
        # it); a world of fakes keeps it in memory with its state directory, across restarts.
        marks = systems.marks or (Marks(marks_dir(Path(d.socket).parent, instance)) if real
                                  else memory_marks(systems.store))
        starting = (Marks(marks_dir(Path(d.socket).parent, instance, "starting")) if real and systems.marks is None
                    else memory_marks(systems.store, "starting"))
        self.systemd = systems.systemd
        self.docker = systems.docker
        self.http = systems.http
        self.store = systems.store
        self.vram = Vram(systems.probe, self.systemd, self.outside)
        self.resident = Resident(config, self.systemd, self.http, self.outside, systems.slot_files, marks, starting)
        self.engine = ContainerEngine(config.window, self.docker, self.http, self.outside, instance)
        # One engine per engine profile, each with its own container; a bare profile has none.
        engines: dict[str, Engine] = {p.name: ContainerEngine(p.engine, self.docker, self.http, self.outside,
                                                              instance)
                                      for p in config.engine_profiles() if p.name != DEFAULT_PROFILE}
        self.window = Window(config, self.resident, self.engine, self.vram, self.store, self.notifier, self.outside,
                             engines=engines, files=systems.files if systems.files is not None else PageCache())
        self.server = Server(
            config,
            self.window,
            self.store,
            self.systemd,
            self.outside,
            lambda profile: make_plan(config, self.resident, self.window.engine_of(profile), self.vram,
                                      self.window.parked, config.profile(profile), self.known_bad,
                                      self.window.files),
            instance=instance,
            host=systems.host,
        )
        self.observers = Observers(config, self.window, self.server, bus or EventBus(), instance)
        self._stop = asyncio.Event()
        self._reconciler: asyncio.Task[None] | None = None
        self._baseline: asyncio.Task[None] | None = None
        self.forced = False  # a second SIGTERM or SIGINT: give up the restore
        self._signals = 0
        self._own_socket: str | None = None

    async def run(self) -> int:
        """Start up, serve until asked to stop, shut down."""
        try:
            sock = await self.startup()
        except ConfigError as err:
            print(f"gpuswapd: {err.message}", file=sys.stderr)
            return EX_CONFIG
        except GpuswapError as err:
            print(f"gpuswapd: cannot start: {err.message}", file=sys.stderr)
            return 1
        await self.begin()
        await self.server.start(sock)
        self.notifier.send(ready="1")
        self.window.notify_status()
        log.info("gpuswapd_ready", version=__version__, socket=self.config.daemon.socket, instance=self.instance)
        watchdog = spawn(self._feed_watchdog(), "watchdog")
        await self._stop.wait()
        watchdog.cancel()
        return await self.shutdown()

    async def startup(self) -> socket.socket:
        """Check the state dir, systemd and Docker, recover a left-over window, take the socket."""
        clock.anchor()  # the daemon's time starts at the wall clock: the state document's times read as such
        self.store.prepare()
        raise_fd_limit(self.config.daemon.max_clients)
        await self.connect()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.observers.start()
        sock = activation_socket()
        if sock is None:
            d = self.config.daemon
            # status_public promises every local user status: the socket must let them connect.
            sock = own_socket(d.socket, d.socket_group, 0o666 if d.status_public else 0o660)
            self._own_socket = d.socket
        return sock

    async def connect(self) -> None:
        """Connect to systemd, follow the units' states, check the images and the engines' settings."""
        await self.outside.systemd.call("connect", self.systemd.connect)
        loop = asyncio.get_running_loop()

        def on_state(unit: str, state: str) -> None:  # called from the GLib thread
            if state in ("inactive", "failed"):
                loop.call_soon_threadsafe(lambda: spawn(self.window.unit_gone(unit), "unit-gone"))
            loop.call_soon_threadsafe(self.window.resident_state, unit, state)

        await self.outside.systemd.call("connect", self.systemd.watch_active_state, on_state)
        try:  # before any signal matters: a resident unit configured by an alias is signalled by its Id
            self.window.learn_names(await self.resident.unit_states(self.config.resident.units))
        except GpuswapError as err:
            log.warning("resident_names_unread", error=err.message, consequence="learned at the next reconcile")
        await self._watch_resume(loop)
        docker_up = await self._check_image()
        await self._check_engines(docker_up)

    async def _watch_resume(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake every nap when the machine resumes (logind); without logind, naps stay a few seconds."""
        watch = getattr(self.systemd, "watch_resume", None)  # the simulation's systemd has no logind
        told = False
        if watch is not None:
            try:
                told = await self.outside.systemd.call("connect", watch,
                                                       lambda: loop.call_soon_threadsafe(naps.resumed))
            except GpuswapError as err:
                log.info("resume_unwatched", error=err.message)
        naps.resumes_told(told)
        log.info("durations_on_boottime", resume_from="logind" if told else None, longest_nap_s=naps.longest())

    async def begin(self) -> None:
        """Take up what an earlier gpuswapd left, before serving anyone; then look at the resident while idle."""
        # Reconcile before serving: nobody sees a container no record knows about.
        await recover_at_start(self.window)
        # What the resident is while nothing has touched it: the baseline later restores compare with.
        self._baseline = spawn(identity.record_at_start(self.window), "resident-baseline")
        if self.config.daemon.reconcile > 0:
            self._reconciler = spawn(self._reconcile(self.config.daemon.reconcile), "reconcile")

    async def _reconcile(self, every: float) -> None:
        """While no window is open, report the resident if it is down (Window.reconcile: it is never started).

        The first look is at once: a gpuswapd that starts with the resident down says so.
        """
        while not self.window.stopping.is_set():
            try:
                await self.window.reconcile()
            except GpuswapError as err:  # systemd cannot say now: ask again next time
                log.warning("reconcile_failed", error=err.message)
            await sleep_unless(self.window.stopping, every)

    async def _check_image(self) -> bool:
        """Refuse to start on a configured image that Docker does not have; Docker may be down (False)."""
        try:
            await self.outside.docker.call("ping", self.docker.ping)
            for p in self.config.engine_profiles():
                c = p.engine.container
                if c.create and not await self.outside.docker.call("image_present", self.docker.image_present,
                                                                   c.image):
                    where = "window" if p.name == DEFAULT_PROFILE else f"profiles.{p.name}"
                    raise ConfigError(f"{where}.container.image: {c.image!r} is not in Docker "
                                      f"(`docker pull {c.image}` or `docker load` it)")
        except DockerUnavailable as err:
            log.warning("docker_unavailable_at_start", error=err.message)
            return False
        return True

    async def _check_engines(self, ask_docker: bool) -> None:
        """Warn of compile caches kept nowhere and known-bad settings; refuse a refusing row (exit 78)."""
        if self.known_bad is None:
            self.known_bad = knownbad.load_table()
        refusals = []
        for p in self.config.engine_profiles():
            view = await self.window.engine_of(p.name).settings(ask_docker)
            if view is not None:
                found = bootchecks.check(p, view, self.known_bad)
                bootchecks.log_check(found)
                refusals += found.refusals()
        if refusals:
            raise ConfigError("; ".join(refusals))

    def _on_signal(self, sig: int) -> None:
        # As uvicorn's handle_exit: a handler only sets flags. The first signal stops gpuswapd the
        # normal way (restoring the resident); a second one forces it: the close under way stops at
        # its next wait, the record stays for the next start, and the exit status says so.
        self._signals += 1
        if self._signals > 1:
            log.warning("forced_exit", signal=signal.Signals(sig).name,
                        consequence="the window is left for the next start of gpuswapd to finish")
            self.forced = True
            self.window.abort.set()
            return
        log.info("stopping", signal=signal.Signals(sig).name, on_shutdown=self.config.daemon.on_shutdown)
        self._stop.set()

    async def _feed_watchdog(self) -> None:
        interval = self.notifier.watchdog_interval()
        while interval is not None:
            self.notifier.send(watchdog="1")
            await asyncio.sleep(interval)

    async def _system_stopping(self) -> bool:
        """Tell whether the whole system is shutting down: systemd would refuse to start the resident."""
        try:
            stopping = await self.outside.systemd.call("system_state", self.systemd.system_state) == "stopping"
        except GpuswapError:
            return False
        if stopping:
            log.warning(
                "system_stopping_window_kept",
                reason="the system is shutting down; the next start of gpuswapd finishes the restore",
            )
        return stopping

    async def shutdown(self) -> int:
        """Stop serving; restore the resident first when ``on_shutdown = "restore"``; return the exit status.

        The status is non-zero when the GPU could not be given back within the bound, or the
        state could not be written: the record then stays for the next start to finish.
        """
        # The bound counts from the signal: asking systemd, or closing the clients, comes out of it.
        ends = clock.monotonic() + failpoints.shutdown_bound(SHUTDOWN_BOUND_S)
        self.notifier.send(stopping="1", status=f"stopping ({self.window.phase})")
        self.window.refuse_new()  # at once: the checks below may take a while
        restore = self.config.daemon.on_shutdown == "restore" and not await self._system_stopping()
        await self.server.close()
        await reap(self._reconciler)
        await reap(self._baseline)
        given_back = await self.window.shutdown(restore=restore, bound=max(0.0, ends - clock.monotonic()))
        saved = await self.window.writer.stop(timeout=WRITER_STOP_S)
        await self.observers.close()
        await self.http.aclose()
        self.systemd.close()
        if self._own_socket is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._own_socket)
        if given_back and saved and not self.forced:
            log.info("gpuswapd_stopped")
            return 0
        log.error("gpuswapd_stopped", given_back=given_back, state_saved=saved,
                  consequence="the next start of gpuswapd finishes the restore from the state it finds")
        return 1


def main(argv: list[str] | None = None) -> int:
    """Run the daemon (``gpuswapd --config PATH``)."""
    parser = argparse.ArgumentParser(
        prog="gpuswapd", description="Hand the GPU between a resident model and an engine."
    )
    parser.add_argument("--config", help=f"configuration file (default {DEFAULT_PATH}; with --instance NAME, "
                                         f"{instances.CONFIG_DIR}/NAME.toml)")
    parser.add_argument("--instance", metavar="NAME",
                        help="run as instance NAME of gpuswapd@.service: one gpuswapd per GPU, with the socket "
                             f"{instances.RUNTIME_DIR}/NAME.sock and the state {instances.STATE_ROOT}/NAME")
    parser.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--version", action="version", version=f"gpuswapd {__version__}")
    args = parser.parse_args(argv)
    bus = EventBus()
    setup_logging(args.log_level, tap=bus.tap)
    instance = DEFAULT_INSTANCE
    try:
        if args.instance is None:
            path = args.config or str(DEFAULT_PATH)
            config = load_config(path)
        else:
            instance = instances.check_name(args.instance)
            path = args.config or str(instances.config_path(instance))
            config = instances.load_instance_config(path, instance)
        table = knownbad.load_table()
    except ConfigError as err:
        for line in err.message.splitlines():  # every error found, one a line
            print(f"gpuswapd: {line}", file=sys.stderr)
        return EX_CONFIG
    if args.check_config:
        checks = bootchecks.check_config(config, table)
        machine = check_machine(config)
        found = config_warnings(config) + (instances.warnings(config, instance) if args.instance else [])
        for warning in found + [w for c in checks for w in c.warnings()] + machine.warnings:
            print(f"gpuswapd: warning: {warning}", file=sys.stderr)
        refusals = [r for c in checks for r in c.refusals()] + machine.errors
        for refusal in refusals:
            print(f"gpuswapd: {refusal}", file=sys.stderr)
        if refusals:
            return EX_CONFIG
        print(f"{path}: ok")
        return 0
    if args.instance is not None:
        # Every line an instance logs says which one: several share one journal.
        structlog.contextvars.bind_contextvars(instance=instance)
    return asyncio.run(Daemon(config, bus, instance, known_bad=table).run())
