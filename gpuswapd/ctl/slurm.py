"""Slurm's node Prolog and Epilog: hand a job's GPUs through gpuswapd, and reconcile what a lost Epilog left.

slurmd runs ``gpuswapctl slurm-prolog`` (``Prolog=``) as root when a job is allocated the node
(``PrologFlags=Alloc``) and ``gpuswapctl slurm-epilog`` (``Epilog=``) when it ends. The map
(``/etc/gpuswapd/slurm/gpus.toml``, or ``$GPUSWAPD_SLURM_MAP``) ties each GPU index as Slurm numbers
it (``SLURM_JOB_GPUS``) to a gpuswapd instance and names the default profile; a job asks for
another with ``--comment=gpuswap:PROFILE``, read from slurmd's own ``SLURM_JOB_COMMENT`` (or
squeue), never from a line the user's job name shares. A bad or unknown profile cancels the job
and leaves the node in service; so does a Prolog whose acquires do not finish within its bound, a
little below Slurm's ``PrologEpilogTimeout`` (a job waiting behind a long lease: past that timeout
slurmd would kill the Prolog and drain the node); any other failure fails the Prolog (the node
drains). Each GPU's lease is held by
``slurm-job-ID`` "for infinity": only the Epilog's release, or ``slurm-reconcile`` once Slurm no
longer runs the job, ends it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from typing import Any

from gpuswapd.ctl.client import Client, Unreachable
from gpuswapd.errors import AcquireTimeout, GpuswapError, LeaseNotFound, Stopping, UnknownProfile
from gpuswapd.instances import DEFAULT_INSTANCE, socket_of, valid_name

MAP_PATH = "/etc/gpuswapd/slurm/gpus.toml"
MAP_ENV = "GPUSWAPD_SLURM_MAP"
HOLDER_PREFIX = "slurm-job-"
COMMENT_PREFIX = "gpuswap:"
SLURM_TIMEOUT_S = 30.0  # scontrol/squeue: slurmctld answers in well under a second when it is up
_PROFILE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_HOLDER = re.compile(rf"^{HOLDER_PREFIX}(\d+)$")
EXIT_OK, EXIT_FAILED = 0, 1
RELEASE_RETRY_S = 20.0  # how long a release waits for a gpuswapd that went away (a restart) to answer again
RELEASE_BACKOFF_S = (0.2, 2.0)  # between tries: first, cap
NO_TIMEOUT = 65534  # Slurm's NO_VAL16: PrologEpilogTimeout unset, slurmd waits for the Prolog for ever
PROLOG_MARGIN_S = (5.0, 0.1)  # the bound is this far below PrologEpilogTimeout: at least 5 s, or a tenth


class SlurmError(Exception):
    """The map, Slurm or gpuswapd stood in the way; the message says which and what next."""


@dataclass(frozen=True)
class GpuMap:
    """Which gpuswapd instance drives each GPU index Slurm hands out, and the default profile."""

    gpus: dict[str, str]
    default_profile: str
    path: str

    def instance(self, gpu: str) -> str:
        """Return the instance of Slurm's GPU ``gpu``, or say the map lacks it."""
        try:
            return self.gpus[gpu]
        except KeyError:
            raise SlurmError(f"GPU {gpu} is not in {self.path}: add it under [gpus] "
                             f"(\"{gpu}\" = \"INSTANCE\")") from None


def load_map(path: str | None = None) -> GpuMap:
    """Read and check the map ($GPUSWAPD_SLURM_MAP, or /etc/gpuswapd/slurm/gpus.toml)."""
    path = path or os.environ.get(MAP_ENV) or MAP_PATH
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise SlurmError(f"cannot read the GPU map {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise SlurmError(f"{path} is not TOML: {err}") from None
    unknown = set(data) - {"gpus", "default_profile"}
    if unknown:
        raise SlurmError(f"{path}: unknown key(s) {', '.join(sorted(unknown))} (expected gpus, default_profile)")
    gpus = data.get("gpus")
    if not isinstance(gpus, dict) or not gpus:
        raise SlurmError(f"{path}: [gpus] must map each GPU index to an instance, e.g. \"0\" = \"0\"")
    for gpu, name in gpus.items():
        if not gpu.isdigit() or not isinstance(name, str) or not (name == DEFAULT_INSTANCE or valid_name(name)):
            raise SlurmError(f"{path}: gpus.{gpu} = {name!r}: expected a GPU index and an instance name")
    profile = data.get("default_profile", "default")
    if not isinstance(profile, str) or not _PROFILE.match(profile):
        raise SlurmError(f"{path}: default_profile = {profile!r} is not a profile name")
    return GpuMap(dict(gpus), profile, path)


def _slurm(*argv: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmError(f"{argv[0]} failed: {err}") from None
    if out.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


class JobFault(SlurmError):
    """The job asked for something this node cannot give it (a bad or unknown profile): fail the job, not the node."""


def job_comment(job_id: str) -> str:
    """Read a job's --comment: from slurmd's Prolog environment, else from slurmctld as a field of its own.

    Never from ``scontrol -o show job``: its line puts the user's ``JobName=``, ``Command=`` and
    ``WorkDir=`` before ``Comment=``, so a job named ``x Comment=gpuswap:Oops`` would be read as
    asking for that profile. slurmd sets ``SLURM_JOB_COMMENT`` for the Prolog (22.05); otherwise
    ``squeue --json`` (21.08 and later) or the comment alone (``-o %k``) says it.
    """
    comment = os.environ.get("SLURM_JOB_COMMENT")
    if comment is not None:
        return comment
    try:
        jobs = json.loads(_slurm("squeue", "--json", "--all", "-j", job_id)).get("jobs") or []
    except (SlurmError, ValueError):
        out = _slurm("squeue", "-h", "--all", "-j", job_id, "-o", "%k").rstrip("\n")
        return "" if out == "(null)" else out
    for job in jobs:
        if isinstance(job, dict) and str(job.get("job_id")) == job_id:
            return str(job.get("comment") or "")
    raise SlurmError(f"squeue does not know job {job_id}")


def job_profile(job_id: str, gpu_map: GpuMap) -> str:
    """Pick the job's profile: ``--comment=gpuswap:PROFILE``, or the map's default."""
    comment = job_comment(job_id)
    if not comment.startswith(COMMENT_PREFIX):
        return gpu_map.default_profile
    profile = comment[len(COMMENT_PREFIX):]
    if not _PROFILE.match(profile):
        raise JobFault(f"job {job_id} asks for profile {profile[:80]!r} in its comment: not a profile name "
                       "(lowercase letters, digits and '-')")
    return profile


def running_jobs() -> set[str]:
    """List the jobs Slurm still runs (or sets up, or winds down), in every partition: their raw job ids.

    ``--all``: without it squeue leaves out the jobs of hidden partitions, which would look finished
    and lose their leases mid-job.
    """
    out = _slurm("squeue", "--all", "-h", "-o", "%A", "-t", "CONFIGURING,RUNNING,COMPLETING,SUSPENDED,STOPPED")
    return {line.strip() for line in out.splitlines() if line.strip()}


def job_gpus(value: str | None) -> list[str]:
    """Split SLURM_JOB_GPUS ("0,1") into GPU indices."""
    return [g.strip() for g in (value or "").split(",") if g.strip()]


def _job_id() -> str:
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise SlurmError(f"SLURM_JOB_ID={job!r}: run this as slurmd's Prolog= or Epilog=, which set it")
    return job


def prolog_timeout(config: str) -> int | None:
    """Read ``PrologEpilogTimeout`` from ``scontrol show config`` (None: unset, slurmd waits for ever)."""
    for line in config.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.strip() == "PrologEpilogTimeout":
            words = value.split()
            if words and words[0].isdigit() and 0 < int(words[0]) < NO_TIMEOUT:
                return int(words[0])
            return None  # UNLIMITED, 65534 (unset)
    return None


def prolog_bound(timeout: int | None) -> float | None:
    """Give the Prolog's acquires a bound below ``timeout``: a job that waits longer is failed, not the node."""
    if timeout is None:
        return None
    least, share = PROLOG_MARGIN_S
    return max(1.0, timeout - min(max(least, share * timeout), timeout / 2))


def prolog() -> int:
    """Acquire a lease on each of the job's GPUs within the bound; on a failure give back what was got.

    The job's own failures (a bad profile, the bound run out) cancel the job and keep the node in
    service (exit 0); gpuswapd or the map in the way fails the Prolog (exit 1: the node drains).
    """
    started = time.monotonic()
    try:
        job = _job_id()
        gpus = job_gpus(os.environ.get("SLURM_JOB_GPUS"))
        if not gpus:
            return EXIT_OK  # a job without GPUs: nothing to hand over
        gpu_map = load_map()
        instances = [gpu_map.instance(g) for g in gpus]
        profile = job_profile(job, gpu_map)
    except JobFault as err:
        return _cancel(job, f"slurm-prolog: {err}")
    except SlurmError as err:
        return _fail(None, f"slurm-prolog: {err}")
    try:
        timeout = prolog_timeout(_slurm("scontrol", "show", "config"))
    except SlurmError as err:
        return _fail(job, f"slurm-prolog: job {job}: cannot read PrologEpilogTimeout: {err}")
    bound = prolog_bound(timeout)
    holder = f"{HOLDER_PREFIX}{job}"
    got: list[tuple[str, str]] = []
    for gpu, name in zip(gpus, instances, strict=True):
        request: dict[str, Any] = {"op": "acquire", "for": "infinity", "holder": holder, "wait": True}
        if profile != "default":
            request["profile"] = profile
        left = None if bound is None else bound - (time.monotonic() - started)
        try:
            if left is not None:
                if left <= 0:
                    raise AcquireTimeout(f"no time was left of the Prolog's {bound:g}s")
                request["timeout"] = round(left, 3)  # gpuswapd withdraws the acquire then
            with Client(socket_of(name)) as client:
                # A line within the bound, and a little more: the daemon's own answer says why.
                reply = client.request(request, timeout=None if left is None else left + PROLOG_MARGIN_S[0])
        except (Unreachable, GpuswapError, OSError) as err:
            why = err.message if isinstance(err, GpuswapError) else str(err)
            if isinstance(err, UnknownProfile):
                why = f"job {job} asks for profile {profile!r}, which gpuswapd instance {name} does not have: {why}"
            late = isinstance(err, AcquireTimeout) or (bound is not None and time.monotonic() - started >= bound)
            if late:
                # No "=" in it: scontrol update cuts an AdminComment short at a second one.
                why = (f"not ready within the Prolog's bound of {bound:g}s ({timeout}s of PrologEpilogTimeout less a "
                       f"margin): {why}; "
                       "the job is cancelled, the node stays in service: submit it again later")
            undone = _give_back(got)
            message = f"slurm-prolog: job {job}: GPU {gpu} (gpuswapd instance {name}): {why}{undone}"
            # An unknown profile, or a wait past the bound, is the job's: it fails, the node stays in service.
            return _cancel(job, message) if isinstance(err, UnknownProfile) or late else _fail(job, message)
        got.append((name, reply["lease"]["id"]))
        print(f"slurm-prolog: job {job}: GPU {gpu} held (instance {name}, profile {reply.get('profile', profile)}, "
              f"lease {reply['lease']['id']})", file=sys.stderr)
    return EXIT_OK


def _give_back(got: list[tuple[str, str]]) -> str:
    left = []
    for name, lease in got:
        try:
            with Client(socket_of(name)) as client:
                client.request({"op": "release", "lease": lease})
        except (Unreachable, GpuswapError, OSError) as err:
            left.append(f"lease {lease} on instance {name} ({err})")
    if left:
        return "; could not give back " + ", ".join(left) + ": run gpuswapctl slurm-reconcile"
    return f"; gave back the {len(got)} GPU(s) it had got" if got else ""


def _fail(job: str | None, message: str) -> int:
    """Fail the Prolog: slurmd drains the node and requeues the job held (the node cannot serve GPUs now)."""
    print(message, file=sys.stderr)
    if job is not None:
        _record(job, message)
    return EXIT_FAILED


def _cancel(job: str, message: str) -> int:
    """Fail the job, not the node: cancel it from the Prolog and succeed, so slurmd keeps the node in service.

    A Prolog that exits non-zero drains the node for everyone; a job that asks for a profile no
    instance has is its submitter's mistake. The reason goes to the job's AdminComment; the job
    ends CANCELLED (Reason=Prolog) before any of its processes start. If it cannot be cancelled,
    the Prolog fails after all: the job must never run without its GPU.
    """
    print(message, file=sys.stderr)
    _record(job, message)
    try:
        _slurm("scancel", job)
    except SlurmError as err:
        print(f"slurm-prolog: could not cancel job {job}, so the Prolog fails (the node drains): {err}",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _record(job: str, message: str) -> None:
    # slurmd logs only "prolog failed": put the reason where `scontrol show job` shows it.
    try:
        _slurm("scontrol", "update", f"JobId={job}", f"AdminComment={message[:900]}")
    except SlurmError as err:
        print(f"slurm-prolog: could not record the reason on job {job}: {err}", file=sys.stderr)


def release_job(job: str, instances: list[str], must_reach: set[str]) -> list[str]:
    """Release ``slurm-job-JOB``'s leases on ``instances``; return what failed (nothing held is no failure).

    An instance in ``must_reach`` that went away (a restart of gpuswapd: its connection dropped, or
    it said it stops) is asked again, with backoff, for up to ``RELEASE_RETRY_S``: a release by
    holder is the same when made twice, and a failed Epilog drains the node.
    """
    failed = []
    for name in instances:
        try:
            reply = _release(name, f"{HOLDER_PREFIX}{job}", patient=name in must_reach)
        except LeaseNotFound:
            continue
        except Unreachable as err:
            if name in must_reach:
                failed.append(f"instance {name}: {err}")
            continue
        except (GpuswapError, OSError) as err:
            failed.append(f"instance {name}: {err}")
            continue
        for lease in reply["released"]:
            print(f"released lease {lease['id']} of {lease['holder']} (instance {name})", file=sys.stderr)
    return failed


def _release(instance: str, holder: str, patient: bool) -> dict[str, Any]:
    """Ask one instance to release a holder's leases; ``patient``: through a restart of gpuswapd too."""
    deadline = time.monotonic() + RELEASE_RETRY_S
    delay = RELEASE_BACKOFF_S[0]
    while True:
        try:
            with Client(socket_of(instance)) as client:
                return client.request({"op": "release", "holder": holder})
        except (Unreachable, Stopping):
            if not patient or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, RELEASE_BACKOFF_S[1])


def epilog() -> int:
    """Release the job's leases; exit 0 when there was nothing to release, 1 only when a release failed."""
    try:
        job = _job_id()
        gpu_map = load_map()
        mine = {gpu_map.gpus[g] for g in job_gpus(os.environ.get("SLURM_JOB_GPUS")) if g in gpu_map.gpus}
    except SlurmError as err:
        print(f"slurm-epilog: {err}", file=sys.stderr)
        return EXIT_FAILED
    # Every instance of the map: SLURM_JOB_GPUS may be missing from an Epilog's environment.
    failed = release_job(job, sorted(set(gpu_map.gpus.values())), must_reach=mine)
    for failure in failed:
        print(f"slurm-epilog: job {job}: could not release: {failure}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def reconcile() -> int:
    """Release the ``slurm-job-*`` leases of jobs Slurm no longer runs (a lost Epilog, a crashed node)."""
    try:
        gpu_map = load_map()
        instances = sorted(set(gpu_map.gpus.values()))
        held: dict[str, set[str]] = {}
        for name in instances:
            with Client(socket_of(name)) as client:
                status = client.request({"op": "status"})
            for lease in (status.get("window") or {}).get("leases") or []:
                found = _HOLDER.match(lease["holder"])
                if found:
                    held.setdefault(found.group(1), set()).add(name)
        if not held:
            return EXIT_OK
        alive = running_jobs()  # asked after the leases were read: a job that started since keeps its lease
    except (SlurmError, Unreachable, GpuswapError, OSError) as err:
        print(f"slurm-reconcile: {err}", file=sys.stderr)
        return EXIT_FAILED
    failed = []
    for job, where in sorted(held.items()):
        if job in alive:
            continue
        print(f"slurm-reconcile: job {job} no longer runs in Slurm: releasing its leases", file=sys.stderr)
        failed += release_job(job, sorted(where), must_reach=where)
    for failure in failed:
        print(f"slurm-reconcile: could not release: {failure}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK
