"""Leases for infinity (root only, never capped) and the Slurm commands' map, on fakes."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuswapd.ctl import slurm
from gpuswapd.ctl.slurm import SlurmError, job_gpus, load_map
from gpuswapd.errors import (
    AcquireTimeout,
    GpuswapError,
    LeaseNotFound,
    PermissionDenied,
    RequestError,
    ResidentBusy,
    UnknownProfile,
)
from gpuswapd.leases import Lease
from gpuswapd.protocol import parse_request
from gpuswapd.record import _lease
from gpuswapd.server.listen import own_socket
from gpuswapd.server.peers import Peer
from tests.fakes import FakeWorld, running, settle
from tests.unit.conftest import ask, run, serve


def test_infinity_is_a_lease_span_but_no_timeout() -> None:
    assert parse_request(b'{"op": "acquire", "for": "infinity"}').duration == math.inf
    with pytest.raises(RequestError):
        parse_request(b'{"op": "acquire", "timeout": "infinity"}')
    with pytest.raises(RequestError):
        parse_request(b'{"op": "acquire", "for": 1e400}')


def test_only_root_may_hold_a_lease_for_infinity_and_it_is_never_capped(tmp_path: Path) -> None:
    server, _ = serve(FakeWorld(), tmp_path)
    assert server._cap(math.inf, Peer(1, 0, 0)) == (math.inf, False)
    with pytest.raises(PermissionDenied, match="only root may take a lease for infinity"):
        server._cap(math.inf, Peer(2, 1000, 1000))
    assert server._cap(1e9, Peer(2, 1000, 1000)) == (server.config.daemon.max_lease, True)


def test_a_lease_for_infinity_holds_the_window_until_released(tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            reply = await ask(path, {"op": "acquire", "for": "infinity", "holder": "slurm-job-7"})
            if os.getuid() != 0:  # makepkg's check() runs as a build user: refused, as any non-root is
                assert reply["error"]["code"] == "permission_denied" and "only root" in reply["error"]["message"]
                await server.close()
                return
            assert reply["ok"] and reply["capped"] is False
            assert (reply["lease"]["expires_at"], reply["lease"]["remaining_s"]) == (None, None)
            await asyncio.sleep(0.2)
            status = await ask(path, {"op": "status"})
            assert [lease["holder"] for lease in status["window"]["leases"]] == ["slurm-job-7"]
            assert (await ask(path, {"op": "release", "holder": "slurm-job-7"}))["ok"]
            await settle(w)
            await server.close()

    run(main())


def test_a_lease_for_infinity_survives_the_state_document() -> None:
    lease = Lease("a1", "slurm-job-7", 1.0, math.inf, None, 0)
    assert Lease.from_dict(lease.to_dict()).expires_at == math.inf
    assert _lease(lease.to_dict(), "window.leases[0]").expires_at == math.inf


def test_the_map_names_what_is_wrong(tmp_path: Path) -> None:
    good = tmp_path / "gpus.toml"
    good.write_text('default_profile = "bare"\n[gpus]\n"0" = "0"\n"1" = "gpu1"\n')
    gpu_map = load_map(str(good))
    assert (gpu_map.gpus, gpu_map.default_profile) == ({"0": "0", "1": "gpu1"}, "bare")
    with pytest.raises(SlurmError, match=r"GPU 2 is not in .*gpus\.toml"):
        gpu_map.instance("2")
    for text, why in (("[gpus]\n", "must map each GPU"), ('[gpus]\n"x" = "0"\n', "expected a GPU index"),
                      ('default_profile = "Big"\n[gpus]\n"0" = "0"\n', "not a profile name"),
                      ('gpu = 1\n[gpus]\n"0" = "0"\n', "unknown key")):
        good.write_text(text)
        with pytest.raises(SlurmError, match=why):
            load_map(str(good))
    with pytest.raises(SlurmError, match="cannot read the GPU map"):
        load_map(str(tmp_path / "missing.toml"))
    assert job_gpus("0,1") == ["0", "1"] and job_gpus("") == [] and job_gpus(None) == []


class FakeClients:
    """gpuswapd instances by socket: what each was asked, and the error an instance answers acquire with."""

    def __init__(self, failing: dict[str, GpuswapError]) -> None:
        self.failing = failing
        self.asked: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, path: str) -> FakeClients.One:
        return FakeClients.One(self, Path(path).stem)

    class One:
        def __init__(self, clients: FakeClients, name: str) -> None:
            self.clients, self.name = clients, name

        def __enter__(self) -> FakeClients.One:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def request(self, req: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
            self.clients.asked.append((self.name, req))
            if req["op"] == "acquire" and self.name in self.clients.failing:
                raise self.clients.failing[self.name]
            if req["op"] == "release" and "holder" in req:
                raise LeaseNotFound(f"{req['holder']} holds no lease")
            return {"ok": True, "lease": {"id": f"lease-{self.name}"}, "released": [], "profile": "default"}


class FakeSlurm:
    """Slurm's commands: what each was asked, squeue's job (its comment), its config, and commands that fail."""

    def __init__(self, comment: str = "", failing: tuple[str, ...] = (), config: str = "") -> None:
        self.comment = comment
        self.failing = failing
        self.config = config
        self.ran: list[tuple[str, ...]] = []

    def __call__(self, *argv: str) -> str:
        self.ran.append(argv)
        if argv[0] in self.failing or " ".join(argv[:2]) in self.failing:
            raise SlurmError(f"{argv[0]} failed")
        if argv[:2] == ("squeue", "--json"):
            return json.dumps({"jobs": [{"job_id": 7, "name": "x Comment=gpuswap:Oops", "comment": self.comment}]})
        if argv[0] == "squeue" and "%k" in argv:
            return self.comment + "\n"
        if argv[:3] == ("scontrol", "show", "config"):
            return self.config
        return ""


def _prolog(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failing: dict[str, GpuswapError],
            comment: str | None = None, fake: FakeSlurm | None = None,
            clients: FakeClients | None = None) -> tuple[int, FakeClients]:
    gpu_map = tmp_path / "gpus.toml"
    gpu_map.write_text('[gpus]\n"0" = "a"\n"1" = "b"\n')
    clients = clients or FakeClients(failing)
    monkeypatch.setattr(slurm, "Client", clients)
    monkeypatch.setattr(slurm, "_slurm", fake or FakeSlurm())
    monkeypatch.setenv("GPUSWAPD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv(slurm.MAP_ENV, str(gpu_map))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1")
    if comment is None:
        monkeypatch.delenv("SLURM_JOB_COMMENT", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_COMMENT", comment)
    return slurm.prolog(), clients


def test_a_prolog_that_gets_one_gpu_of_two_gives_it_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, clients = _prolog(monkeypatch, tmp_path, {"b": ResidentBusy("strata.service is busy")})
    assert code == 1
    assert [(name, req["op"]) for name, req in clients.asked] == [("a", "acquire"), ("b", "acquire"), ("a", "release")]
    assert clients.asked[0][1] == {"op": "acquire", "for": "infinity", "holder": "slurm-job-7", "wait": True}
    assert clients.asked[2][1] == {"op": "release", "lease": "lease-a"}
    err = capsys.readouterr().err
    assert "job 7: GPU 1 (gpuswapd instance b): strata.service is busy; gave back the 1 GPU(s)" in err


def test_an_unknown_profile_cancels_the_job_and_keeps_the_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurm()
    code, clients = _prolog(monkeypatch, tmp_path, {"b": UnknownProfile("no profile 'huge'")}, "gpuswap:huge", fake)
    assert code == 0  # a Prolog that fails drains the node: this one cancels the job instead
    assert clients.asked[0][1]["profile"] == "huge"
    assert [(name, req["op"]) for name, req in clients.asked] == [("a", "acquire"), ("b", "acquire"), ("a", "release")]
    assert "job 7 asks for profile 'huge', which gpuswapd instance b does not have" in capsys.readouterr().err
    update = next(argv for argv in fake.ran if argv[:2] == ("scontrol", "update"))
    assert update[2] == "JobId=7" and "asks for profile 'huge'" in update[3]
    assert fake.ran[-1] == ("scancel", "7")


@pytest.mark.parametrize("comment", ["gpuswap:Big", "gpuswap:x y", "gpuswap:", "gpuswap:" + "a" * 70])
def test_a_bad_profile_name_cancels_the_job_before_asking_gpuswapd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                   comment: str) -> None:
    fake = FakeSlurm()
    code, clients = _prolog(monkeypatch, tmp_path, {}, comment, fake)
    assert code == 0 and clients.asked == [] and fake.ran[-1] == ("scancel", "7")


def test_a_job_that_cannot_be_cancelled_fails_the_prolog(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeSlurm(failing=("scancel",))
    code, _ = _prolog(monkeypatch, tmp_path, {"a": UnknownProfile("no profile 'huge'")}, "gpuswap:huge", fake)
    assert code == 1  # the job must never run without its GPU: the node drains after all


def test_the_comment_is_the_jobs_own_field_whatever_its_name_says(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    # slurmd's own SLURM_JOB_COMMENT first; without it squeue's field (--json, else -o %k), never a line
    # where the user's JobName=, Command= and WorkDir= come before Comment=.
    fake = FakeSlurm(comment="gpuswap:bare")
    code, clients = _prolog(monkeypatch, tmp_path, {}, None, fake)
    assert code == 0 and {req.get("profile") for _, req in clients.asked} == {"bare"}
    assert fake.ran[0] == ("squeue", "--json", "--all", "-j", "7")
    old = FakeSlurm(comment="gpuswap:bare", failing=("squeue --json",))
    monkeypatch.setattr(slurm, "_slurm", old)
    assert slurm.job_comment("7") == "gpuswap:bare"
    assert old.ran[-1] == ("squeue", "-h", "--all", "-j", "7", "-o", "%k")
    monkeypatch.setenv("SLURM_JOB_COMMENT", "gpuswap:eval")
    assert slurm.job_comment("7") == "gpuswap:eval" and len(old.ran) == 2  # no Slurm call at all


def test_reconcile_asks_squeue_for_every_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSlurm()
    monkeypatch.setattr(slurm, "_slurm", fake)
    slurm.running_jobs()
    assert fake.ran == [("squeue", "--all", "-h", "-o", "%A", "-t", "CONFIGURING,RUNNING,COMPLETING,SUSPENDED,STOPPED")]


def test_an_epilog_with_nothing_to_release_succeeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _prolog(monkeypatch, tmp_path, {})
    assert slurm.epilog() == 0


CONFIG = "Configuration data as of 2026-12-01T20:00:00\nPrologEpilogTimeout     = {}\nPrologFlags             = Alloc\n"


@pytest.mark.parametrize(("value", "seconds", "bound"), [
    ("120", 120, 108.0), ("20", 20, 15.0), ("6", 6, 3.0), ("65534", None, None), ("UNLIMITED", None, None)])
def test_the_prologs_bound_is_below_prologepilogtimeout(value: str, seconds: int | None, bound: float | None) -> None:
    assert slurm.prolog_timeout(CONFIG.format(value)) == seconds
    assert slurm.prolog_bound(seconds) == bound
    assert slurm.prolog_timeout("PrologFlags = Alloc\n") is None


def test_a_job_waiting_past_the_bound_is_cancelled_and_the_node_kept(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeSlurm(config=CONFIG.format(120))
    late = AcquireTimeout("the window was not ready within 107.9s (phase now BOOTING); the acquire was withdrawn")
    code, clients = _prolog(monkeypatch, tmp_path, {"b": late}, fake=fake)
    assert code == 0  # the job's, not the node's: slurmd keeps the node in service
    assert [(name, req["op"]) for name, req in clients.asked] == [("a", "acquire"), ("b", "acquire"), ("a", "release")]
    assert 100 < clients.asked[0][1]["timeout"] <= 108 and clients.asked[1][1]["timeout"] <= 108
    assert fake.ran[-1] == ("scancel", "7")
    err = capsys.readouterr().err
    assert "not ready within the Prolog's bound of 108s (120s of PrologEpilogTimeout less a margin)" in err
    assert "gave back" in err


def test_no_time_left_for_the_next_gpu_cancels_the_job_without_asking(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    fake = FakeSlurm(config=CONFIG.format(20))
    now = [1000.0]
    monkeypatch.setattr(slurm.time, "monotonic", lambda: now[0])

    class Slow(FakeClients):
        def __call__(self, path: str) -> FakeClients.One:
            now[0] += 16.0  # the first GPU took the whole bound (15 s)
            return super().__call__(path)

    clients = Slow({})
    monkeypatch.setattr(slurm, "Client", clients)
    code, _ = _prolog(monkeypatch, tmp_path, {}, fake=fake, clients=clients)
    assert code == 0 and fake.ran[-1] == ("scancel", "7")
    assert [(name, req["op"]) for name, req in clients.asked] == [("a", "acquire"), ("a", "release")]


def test_a_prolog_that_cannot_read_slurms_config_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    code, clients = _prolog(monkeypatch, tmp_path, {}, fake=FakeSlurm(failing=("scontrol show",)))
    assert code == 1 and clients.asked == []


def _epilog_of_gpu_0(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpus: str) -> None:
    """Set up the Epilog of job 7, which had GPU 0, with this map and fast retries."""
    monkeypatch.setattr(slurm, "RELEASE_BACKOFF_S", (0.01, 0.05))
    gpu_map = tmp_path / "gpus.toml"
    gpu_map.write_text(gpus)
    monkeypatch.setenv("GPUSWAPD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv(slurm.MAP_ENV, str(gpu_map))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_GPUS", "0")


def test_an_epilog_whose_gpuswapd_restarts_under_its_release_asks_again(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """gpuswapd of GPU 0 is killed with the release unanswered (a real Unix socket that hangs up), then answers:
    the release is made again and the Epilog succeeds. GPU 1's instance, not the job's, runs no gpuswapd: not
    waited for."""
    _epilog_of_gpu_0(monkeypatch, tmp_path, '[gpus]\n"0" = "a"\n"1" = "b"\n')
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(slurm.socket_of("a"))
    server.listen(4)
    seen: list[dict[str, Any]] = []

    def serve() -> None:
        with server:
            for answer in ("drop", "released"):
                conn, _ = server.accept()
                with conn, conn.makefile("rwb") as f:
                    seen.append(json.loads(f.readline()))
                    if answer == "released":
                        released = [{"id": "000000000003", "holder": "slurm-job-7"}]
                        f.write(json.dumps({"ok": True, "released": released}).encode() + b"\n")
                        f.flush()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert slurm.epilog() == 0
    thread.join(5)
    assert seen == [{"op": "release", "holder": "slurm-job-7"}] * 2


def test_an_epilog_gives_up_on_a_gpuswapd_that_stays_away(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(slurm, "RELEASE_RETRY_S", 0.2)
    _epilog_of_gpu_0(monkeypatch, tmp_path, '[gpus]\n"0" = "a"\n')
    assert slurm.epilog() == 1  # nobody listens on a's socket: the node drains, as before
