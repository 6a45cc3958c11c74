"""The Docker adapter against a real dockerd: ours (in a PID namespace of its own) or $DOCKER_HOST's.

Images come from ``docker import`` of a tiny rootfs; containers bind-mount the host's /usr
read-only and use the host network, so ``/usr/bin/python3`` and ``/usr/bin/sleep`` run in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuswapd.adapters.docker import ContainerState, Docker
from gpuswapd.config import ContainerConfig
from gpuswapd.errors import ContainerNotFound, DockerError, DockerUnavailable, ImageNotFound

IMAGE = "gpuswapd-test-tiny:latest"
IMAGE_CMD = ["/usr/bin/sleep", "31"]
PY = "/usr/bin/python3"
# A PID 1 without a handler ignores SIGTERM; this one exits on it.
ON_TERM_EXIT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


# -- a dockerd of our own -------------------------------------------------------------------


@dataclass
class Dockerd:
    """A dockerd in its own PID namespace, started by this test session."""

    root: Path
    unshare: subprocess.Popen[bytes]
    pid1: int

    @property
    def host(self) -> str:
        return f"unix://{self.root / 'docker.sock'}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """Signal the namespace's PID 1 (dockerd) and reap unshare; SIGKILL ends the namespace."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid1, sig)
        try:
            self.unshare.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGKILL)
            self.unshare.wait(10)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def start_dockerd(*extra: str) -> Dockerd:
    """Start dockerd under unshare with its state in a fresh directory under /var/tmp."""
    if os.geteuid() != 0 or not shutil.which("dockerd") or not shutil.which("unshare"):
        pytest.skip("needs root, dockerd and unshare (or DOCKER_HOST pointing at a live dockerd)")
    root = Path(tempfile.mkdtemp(prefix="gsd-dockerd-", dir="/var/tmp"))
    with open(root / "dockerd.log", "wb") as log:
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "dockerd",
             "--host", f"unix://{root / 'docker.sock'}", "--data-root", str(root / "data"),
             "--exec-root", str(root / "exec"), "--pidfile", str(root / "dockerd.pid"),
             "--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=vfs",
             *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
    deadline = time.monotonic() + 30
    while not _children(proc.pid):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"unshare did not start dockerd: {(root / 'dockerd.log').read_text()}")
        time.sleep(0.01)
    daemon = Dockerd(root, proc, _children(proc.pid)[0])
    probe = Docker(daemon.host, timeout=2)
    while True:
        try:
            probe.ping()
            return daemon
        except DockerUnavailable:
            if proc.poll() is not None or time.monotonic() > deadline:
                daemon.stop(signal.SIGKILL)
                raise RuntimeError(f"dockerd did not come up: {(root / 'dockerd.log').read_text()}") from None
            time.sleep(0.05)


def cli(host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the docker CLI against ``host``."""
    return subprocess.run(["docker", *args], env={**os.environ, "DOCKER_HOST": host}, check=check,
                          capture_output=True, text=True, timeout=60)


def import_image(host: str, workdir: Path) -> None:
    """Make the tiny image: empty dirs and the merged-/usr symlinks; /usr comes from the host."""
    tar_path = workdir / "rootfs.tar"
    with tarfile.open(tar_path, "w") as tar:
        for d in ("usr", "etc", "tmp", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                             ("sbin", "usr/sbin")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    cli(host, "import", "--change", f"CMD {json.dumps(IMAGE_CMD)}", str(tar_path), IMAGE)


@pytest.fixture(scope="session")
def own_dockerd() -> Iterator[Dockerd | None]:
    """Our dockerd, unless $DOCKER_HOST already points at a live one (then None)."""
    given = os.environ.get("DOCKER_HOST")
    if given:
        try:
            Docker(given, timeout=5).ping()
        except DockerUnavailable:
            pass
        else:
            yield None
            return
    daemon = start_dockerd()
    try:
        yield daemon
    finally:
        # Remove containers first: dockerd's shutdown waits for containers that ignore SIGTERM.
        ids = cli(daemon.host, "ps", "-aq", check=False).stdout.split()
        if ids:
            cli(daemon.host, "rm", "-f", *ids, check=False)
        daemon.stop()
        shutil.rmtree(daemon.root, ignore_errors=True)


@pytest.fixture(scope="session")
def host(own_dockerd: Dockerd | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The DOCKER_HOST the tests use, with the tiny image imported (and removed from a host not ours)."""
    url = own_dockerd.host if own_dockerd else os.environ["DOCKER_HOST"]
    import_image(url, tmp_path_factory.mktemp("image"))
    yield url
    if own_dockerd is None:
        cli(url, "rmi", "-f", IMAGE, check=False)


@pytest.fixture
def docker(host: str) -> Docker:
    return Docker(host)


@pytest.fixture
def names(host: str) -> Iterator[Callable[[], str]]:
    """Hand out unique container names; remove those containers afterwards."""
    made: list[str] = []

    def name() -> str:
        made.append(f"gsdt-{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield name
    if made:
        cli(host, "rm", "-f", *made, check=False)


def spec(name: str, command: list[str], **changes: Any) -> ContainerConfig:
    """A container on the host network with the host's /usr, no GPU."""
    base = ContainerConfig(name=name, image=IMAGE, command=command, volumes={"/usr": "/usr:ro"},
                           network_mode="host", gpus=[])
    return dataclasses.replace(base, **changes)


def inspect(host: str, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(cli(host, "inspect", name).stdout)[0]
    return data


def wait_for(what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- lifecycle ------------------------------------------------------------------------------


def test_create_start_stop_remove(docker: Docker, names: Callable[[], str], host: str) -> None:
    name = names()
    t0 = time.monotonic()
    cid = docker.create(spec(name, [PY, "-c", ON_TERM_EXIT]), {"gpuswapd.test": "lifecycle"})
    created = docker.state(name)
    assert created is not None and created.id == cid and created.name == name
    assert (created.status, created.running, created.exit_code, created.started_at) == (
        "created", False, None, "")
    assert created.labels == {"gpuswapd.test": "lifecycle"}

    docker.start(name)
    running = docker.state(name)
    took_running = time.monotonic() - t0
    assert running is not None and running.running and running.status == "running"
    assert running.started_at and not running.finished_at
    wait_for("the container's first line", lambda: "ready" in docker.logs_tail(name))
    docker.start(name)  # starting a running container is not an error

    t1 = time.monotonic()
    docker.stop(name, timeout=10)
    took_stop = time.monotonic() - t1
    stopped = docker.state(name)
    assert stopped is not None and stopped.status == "exited" and stopped.exit_code == 0
    assert not stopped.oom_killed and stopped.finished_at
    assert took_stop < 5, "the engine exits on SIGTERM: no wait for the kill"
    docker.stop(name, timeout=10)  # already stopped: not an error

    docker.remove(name)
    assert docker.state(name) is None
    assert cli(host, "ps", "-aq", "--filter", f"name={name}").stdout.strip() == ""
    docker.remove(name)  # absent: not an error
    docker.stop(name, timeout=1)  # absent: not an error
    print(f"\ncreate->running {took_running:.3f}s, stop (SIGTERM honoured) {took_stop:.3f}s")


def test_stop_kills_after_the_timeout(docker: Docker, names: Callable[[], str]) -> None:
    name = names()
    docker.create(spec(name, ["/usr/bin/sleep", "30"]), {})  # PID 1 ignores SIGTERM
    docker.start(name)
    t0 = time.monotonic()
    docker.stop(name, timeout=1)
    took = time.monotonic() - t0
    state = docker.state(name)
    assert state is not None and state.status == "exited" and state.exit_code == 137
    assert 0.9 <= took < 5
    print(f"\nstop (SIGTERM ignored, SIGKILL after 1s) {took:.3f}s")


def test_remove_kills_a_running_container(docker: Docker, names: Callable[[], str]) -> None:
    name = names()
    docker.create(spec(name, ["/usr/bin/sleep", "30"]), {})
    docker.start(name)
    docker.remove(name)
    assert docker.state(name) is None


def test_missing_container(docker: Docker) -> None:
    assert docker.state("gsdt-never-made") is None
    with pytest.raises(ContainerNotFound, match=r"cannot start container 'gsdt-never-made'.*docker ps -a"):
        docker.start("gsdt-never-made")
    with pytest.raises(ContainerNotFound, match="cannot wait for container 'gsdt-never-made'"):
        docker.wait_exit("gsdt-never-made", 1)
    with pytest.raises(ContainerNotFound):
        docker.logs_tail("gsdt-never-made")


# -- what create() translates ---------------------------------------------------------------


def test_env_table_over_env_file(docker: Docker, names: Callable[[], str], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "engine.env"
    env_file.write_bytes(
        "\ufeff# the engine's settings\n"
        "\n"
        "A=from-file\n"
        "B=file-loses\n"
        "   INDENTED=kept  as is  \n"
        "QUOTED=\"quotes stay\"\n"
        "EQUALS=a=b=c\n"
        "CRLF=yes\r\n"
        "EMPTY=\n"
        "PASSED\n"
        "UNSET_HERE\n"
        "  # an indented comment\n".encode()
    )
    monkeypatch.setenv("PASSED", "from gpuswapd's environment")
    monkeypatch.delenv("UNSET_HERE", raising=False)
    name = names()
    keys = ["A", "B", "C", "INDENTED", "QUOTED", "EQUALS", "CRLF", "EMPTY", "PASSED", "UNSET_HERE"]
    show = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    docker.create(spec(name, [PY, "-c", show], env_file=str(env_file),
                       env={"B": "table-wins", "C": "only-table"}), {})
    expected = {
        "A": "from-file", "B": "table-wins", "C": "only-table", "INDENTED": "kept  as is  ",
        "QUOTED": '"quotes stay"', "EQUALS": "a=b=c", "CRLF": "yes", "EMPTY": "",
        "PASSED": "from gpuswapd's environment", "UNSET_HERE": None,
    }
    config_env = dict(v.split("=", 1) for v in inspect(docker.where, name)["Config"]["Env"])
    assert {k: config_env.get(k) for k in keys} == expected

    docker.start(name)
    state = docker.wait_exit(name, 10)
    assert state is not None and state.exit_code == 0
    assert json.loads(docker.logs_tail(name, 1)) == expected


def test_env_file_problems(docker: Docker, names: Callable[[], str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.env"
    with pytest.raises(DockerError, match=f"cannot read the env file '{missing}'.*env_file"):
        docker.create(spec(names(), [], env_file=str(missing)), {})
    bad = tmp_path / "bad.env"
    bad.write_text("OK=1\nNOT OK=2\n")
    with pytest.raises(DockerError, match=f"env file '{bad}' line 2: variable 'NOT OK' contains whitespace"):
        docker.create(spec(names(), [], env_file=str(bad)), {})
    nameless = tmp_path / "nameless.env"
    nameless.write_text("=2\n")
    with pytest.raises(DockerError, match="line 1: no variable name"):
        docker.create(spec(names(), [], env_file=str(nameless)), {})


def test_volumes_with_modes(docker: Docker, names: Callable[[], str], tmp_path: Path) -> None:
    models, scratch = tmp_path / "models", tmp_path / "scratch"
    models.mkdir()
    scratch.mkdir()
    (models / "weights").write_text("19.5 GB of weights")
    name = names()
    probe = (
        "import sys\n"
        "print(open('/models/weights').read())\n"
        "open('/scratch/out', 'w').write('written')\n"
        "try:\n"
        "    open('/models/tamper', 'w')\n"
        "except OSError as e:\n"
        "    print(e.strerror); sys.exit(3)\n"
    )
    docker.create(spec(name, [PY, "-c", probe], volumes={
        "/usr": "/usr:ro", str(models): "/models:ro", str(scratch): "/scratch"}), {})
    docker.start(name)
    state = docker.wait_exit(name, 10)
    assert state is not None and state.exit_code == 3
    assert docker.logs_tail(name).split("\n")[:2] == ["19.5 GB of weights", "Read-only file system"]
    assert (scratch / "out").read_text() == "written"
    assert not (models / "tamper").exists()


def test_ports_shm_command_and_gpu_requests(docker: Docker, names: Callable[[], str]) -> None:
    bridged = names()
    docker.create(spec(bridged, [], network_mode="", ports={"8000/tcp": 18777, "9000": 18778},
                       shm_size="64m", gpus=[0, 1]), {})
    data = inspect(docker.where, bridged)
    assert data["HostConfig"]["PortBindings"] == {
        "8000/tcp": [{"HostIp": "", "HostPort": "18777"}],
        "9000/tcp": [{"HostIp": "", "HostPort": "18778"}],
    }
    assert set(data["Config"]["ExposedPorts"]) == {"8000/tcp", "9000/tcp"}
    assert data["HostConfig"]["NetworkMode"] == "default"
    assert data["HostConfig"]["ShmSize"] == 64 * 1024**2
    assert data["Config"]["Cmd"] == IMAGE_CMD  # command [] keeps the image's CMD
    [request] = data["HostConfig"]["DeviceRequests"]
    assert (request["Count"], request["DeviceIDs"], request["Capabilities"]) == (0, ["0", "1"], [["gpu"]])

    hosted = names()
    docker.create(spec(hosted, ["/usr/bin/true"], ports={"8000/tcp": 18777}, gpus="all"), {})
    data = inspect(docker.where, hosted)
    assert not data["HostConfig"]["PortBindings"]  # ignored on the host network
    assert data["HostConfig"]["NetworkMode"] == "host"
    assert data["HostConfig"]["ShmSize"] == 64 * 1024**2  # Docker's default
    assert data["Config"]["Cmd"] == ["/usr/bin/true"]
    [request] = data["HostConfig"]["DeviceRequests"]
    assert (request["Count"], request["Capabilities"]) == (-1, [["gpu"]])


def test_no_gpu_request_when_gpus_is_empty(docker: Docker, names: Callable[[], str]) -> None:
    name = names()
    docker.create(spec(name, ["/usr/bin/true"]), {})
    assert not inspect(docker.where, name)["HostConfig"]["DeviceRequests"]


def test_gpus_without_the_nvidia_toolkit(docker: Docker, names: Callable[[], str]) -> None:
    name = names()
    docker.create(spec(name, ["/usr/bin/true"], gpus="all"), {})  # Docker accepts the request...
    with pytest.raises(DockerError) as caught:  # ...and fails it at start
        docker.start(name)
    assert type(caught.value) is DockerError
    message = caught.value.message
    assert f"cannot start container '{name}'" in message
    assert "could not select device driver" in message
    assert "NVIDIA container toolkit is missing" in message and "nvidia-ctk" in message


# -- labels and find ------------------------------------------------------------------------


def test_labels_and_find(docker: Docker, names: Callable[[], str]) -> None:
    run = uuid.uuid4().hex
    first, second, other = names(), names(), names()
    docker.create(spec(first, ["/usr/bin/true"]), {"gpuswapd.test": run, "role": "engine"})
    docker.create(spec(second, ["/usr/bin/true"]), {"gpuswapd.test": run, "role": "spare"})
    docker.create(spec(other, ["/usr/bin/true"]), {"gpuswapd.test": "another-run"})
    docker.start(second)
    assert docker.wait_exit(second, 10) is not None

    found = {s.name: s for s in docker.find({"gpuswapd.test": run})}
    assert set(found) == {first, second}
    assert found[first].status == "created" and found[second].status == "exited"
    assert found[first].labels == {"gpuswapd.test": run, "role": "engine"}
    assert [s.name for s in docker.find({"gpuswapd.test": run, "role": "spare"})] == [second]
    assert docker.find({"gpuswapd.test": run, "role": "nobody"}) == []


# -- watching: wait_exit and events ---------------------------------------------------------


def collect_events(docker: Docker, watched: list[str], stop: threading.Event,
                   seen: list[tuple[str, str]], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            for event in docker.events(watched, stop):
                seen.append(event)
        except BaseException as err:  # handed to the test
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_exit_seen_by_wait_exit_and_events(docker: Docker, names: Callable[[], str]) -> None:
    name, bystander = names(), names()
    stop = threading.Event()
    seen: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    thread = collect_events(docker, [name], stop, seen, errors)
    docker.create(spec(name, [PY, "-c", "import time, sys; time.sleep(1); sys.exit(3)"]), {})
    docker.create(spec(bystander, ["/usr/bin/true"]), {})
    docker.start(name)
    docker.start(bystander)
    assert docker.wait_exit(name, 0.3) is None  # still running: a timeout is not an error
    t0 = time.monotonic()
    state = docker.wait_exit(name, 10)
    assert isinstance(state, ContainerState)
    assert (state.status, state.exit_code, state.running) == ("exited", 3, False)
    assert time.monotonic() - t0 < 2
    wait_for("the die event", lambda: (name, "die") in seen)
    docker.start(name)  # again: the subscription is certainly live by now
    docker.remove(name)
    wait_for("the destroy event", lambda: (name, "destroy") in seen)
    assert seen[seen.index((name, "die")):] == [(name, "die"), (name, "start"), (name, "die"),
                                                (name, "destroy")]
    assert all(n == name for n, _ in seen)
    t1 = time.monotonic()
    stop.set()
    thread.join(2)
    assert not thread.is_alive() and not errors
    assert time.monotonic() - t1 < 1


def test_events_stop_while_nothing_happens(docker: Docker) -> None:
    stop = threading.Event()
    seen: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    thread = collect_events(docker, ["gsdt-quiet"], stop, seen, errors)
    time.sleep(0.3)  # let it block in the stream
    stop.set()
    thread.join(2)
    assert not thread.is_alive() and seen == [] and errors == []


def test_wait_exit_times_out_on_a_running_container(docker: Docker, names: Callable[[], str]) -> None:
    name = names()
    docker.create(spec(name, ["/usr/bin/sleep", "30"]), {})
    docker.start(name)
    t0 = time.monotonic()
    assert docker.wait_exit(name, 0.5) is None
    assert 0.4 < time.monotonic() - t0 < 2
    assert docker.wait_exit(name, 0) is None
    created = names()
    docker.create(spec(created, ["/usr/bin/true"]), {})
    never_started = docker.wait_exit(created, 5)
    assert never_started is not None and never_started.status == "created"


def test_concurrent_calls_share_one_client(host: str, names: Callable[[], str]) -> None:
    docker = Docker(host)  # not connected yet: the threads race to connect
    batch = [names() for _ in range(6)]
    errors: list[BaseException] = []

    def lifecycle(name: str) -> None:
        try:
            docker.create(spec(name, ["/usr/bin/sleep", "30"]), {"gpuswapd.test": "threads"})
            docker.start(name)
            assert docker.state(name) is not None
            docker.stop(name, 0)
            docker.remove(name)
        except BaseException as err:  # handed to the test
            errors.append(err)

    threads = [threading.Thread(target=lifecycle, args=(n,)) for n in batch]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert all(docker.state(n) is None for n in batch)


# -- the errors a person reads --------------------------------------------------------------


def test_image_missing(docker: Docker, names: Callable[[], str]) -> None:
    assert docker.image_present(IMAGE)
    assert not docker.image_present("hyperqwen:latest")
    with pytest.raises(ImageNotFound) as caught:
        docker.create(spec(names(), [], image="hyperqwen:latest"), {})
    assert caught.value.message == (
        "image 'hyperqwen:latest' not found in Docker: `docker pull hyperqwen:latest` or `docker load` it"
    )


def test_name_conflict(docker: Docker, names: Callable[[], str]) -> None:
    name = names()
    cid = docker.create(spec(name, ["/usr/bin/true"]), {})
    with pytest.raises(DockerError) as caught:
        docker.create(spec(name, ["/usr/bin/true"]), {})
    assert type(caught.value) is DockerError
    assert caught.value.message == (
        f"a container named '{name}' already exists in Docker (id {cid[:12]}): "
        f"remove it with `docker rm -f {name}`"
    )


def test_docker_unreachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"unix://{tmp_path / 'dead.sock'}"
    t0 = time.monotonic()
    with pytest.raises(DockerUnavailable) as caught:
        Docker(dead).ping()
    assert time.monotonic() - t0 < 2
    assert caught.value.message == (
        f"Docker is not answering at {dead} (No such file or directory): "
        "is dockerd running? Check `systemctl status docker`"
    )

    monkeypatch.setenv("DOCKER_HOST", dead)
    docker = Docker()
    for call in (docker.ping, lambda: docker.state("x"), lambda: docker.stop("x", 1),
                 lambda: docker.create(spec("x", []), {}), lambda: list(docker.events(["x"], threading.Event()))):
        with pytest.raises(DockerUnavailable, match=f"at {dead} \\(DOCKER_HOST\\)"):
            call()

    monkeypatch.delenv("DOCKER_HOST")
    assert "/var/run/docker.sock (the default; DOCKER_HOST is not set)" in Docker().where


def test_docker_dying_ends_events_and_waits(tmp_path: Path) -> None:
    # A dockerd of its own, whichever dockerd the other tests use (the world's, once a test of the
    # world has set DOCKER_HOST on this worker): this one is killed.
    doomed = start_dockerd()
    try:
        import_image(doomed.host, tmp_path)
        docker = Docker(doomed.host)
        docker.create(spec("gsdt-doomed", ["/usr/bin/sleep", "30"]), {})
        docker.start("gsdt-doomed")
        stop = threading.Event()
        seen: list[tuple[str, str]] = []
        errors: list[BaseException] = []
        events = collect_events(docker, ["gsdt-doomed"], stop, seen, errors)
        waited: list[BaseException | ContainerState | None] = []

        def wait() -> None:
            try:
                waited.append(docker.wait_exit("gsdt-doomed", 30))
            except BaseException as err:  # handed to the test
                waited.append(err)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(0.3)  # both are blocked on dockerd now
        t0 = time.monotonic()
        doomed.stop(signal.SIGKILL)  # ends the namespace: dockerd, containerd, the container
        events.join(5)
        waiter.join(5)
        assert time.monotonic() - t0 < 5
        assert len(errors) == 1 and isinstance(errors[0], DockerUnavailable), errors
        assert "event stream" in errors[0].message or "not answering" in errors[0].message
        assert len(waited) == 1 and isinstance(waited[0], DockerUnavailable), waited
        with pytest.raises(DockerUnavailable, match=r"Connection refused|No such file"):
            docker.ping()
    finally:
        doomed.stop(signal.SIGKILL)
        shutil.rmtree(doomed.root, ignore_errors=True)
