"""Slurm's node Prolog and Epilog hand the job's GPU through gpuswapd: a real single-node Slurm from Debian.

The ``slurm`` fixture starts munged, slurmctld and slurmd once (a second or two); every job is
submitted by root with ``sbatch --gres=gpu:1`` to the world's one card.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from tests.integration.conftest import assert_resident_back, resident_busy, with_profiles
from tests.stack import llama
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import RESIDENT_UNITS, Probe
from tests.stack.slurm import Slurm
from tests.stack.world import ENGINE_PORT, Stack, _wait

Start = Callable[..., RunningDaemon]
COMPLETION = json.dumps({"model": "hyperqwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})


def link(slurm: Slurm, daemon: RunningDaemon) -> None:
    """Make the test's gpuswapd the one the Prolog and Epilog reach (instance "default"); its gpuswapctl, too."""
    where = Path(slurm.gpuswapd_env["GPUSWAPD_RUNTIME_DIR"]) / "gpuswapd.sock"
    where.unlink(missing_ok=True)
    where.symlink_to(daemon.socket)
    daemon.env.update({**slurm.gpuswapd_env, "SLURM_CONF": str(slurm.conf)})


def sbatch(slurm: Slurm, jobs: Path, script: str, *options: str) -> str:
    """Submit a batch job (root, one GPU); return its id."""
    out = slurm.cmd("sbatch", "--parsable", "--gres=gpu:1", f"--output={jobs}/%j.out", *options,
                    "--wrap", script).stdout
    return out.strip().split(";")[0]


def holders(daemon: RunningDaemon) -> list[str]:
    window = daemon.status().get("window") or {}
    return [lease["holder"] for lease in window.get("leases") or []]


def test_jobs_get_the_card_through_the_prolog_and_give_it_back(gpuswapd: Start, probe: Probe, slurm: Slurm,
                                                              tmp_path: Path) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"linger": "0.5s"})
    link(slurm, daemon)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    go = tmp_path / "go"
    # A makes a completion on the engine, then holds the card until the test lets it go.
    a = sbatch(slurm, jobs, f"curl -sf http://127.0.0.1:{ENGINE_PORT}/v1/chat/completions -H "
                            f"'Content-Type: application/json' -d '{COMPLETION}' > {jobs}/a.json && "
                            f"while [ ! -e {go} ]; do sleep 0.1; done")
    b = sbatch(slurm, jobs, "sleep 600")
    slurm.wait_job(a, {"RUNNING"})
    _wait("A's completion", lambda: (jobs / "a.json").stat().st_size > 0, 30)
    assert json.loads((jobs / "a.json").read_text())["choices"][0]["message"]
    status = daemon.status()
    assert status["phase"] == "READY" and holders(daemon) == [f"slurm-job-{a}"]
    assert status["window"]["leases"][0]["expires_at"] is None  # bound to the job, not to a time
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    job_b = slurm.job(b)
    assert job_b["JobState"] == "PENDING" and job_b["Reason"] == "Resources", job_b

    # The reconciler releases the lease of a job Slurm does not run, and keeps A's.
    assert daemon.ctl("acquire", "--for", "infinity", "--holder", "slurm-job-999999").returncode == 0
    out = daemon.ctl("slurm-reconcile")
    assert out.returncode == 0, out.stderr
    assert "job 999999 no longer runs" in out.stderr
    assert holders(daemon) == [f"slurm-job-{a}"]

    # A ends: its Epilog gives the card back and B's Prolog takes it; scancel of B gives it back.
    go.touch()
    assert slurm.wait_job(a, {"COMPLETED", "FAILED"})["JobState"] == "COMPLETED"
    slurm.wait_job(b, {"RUNNING"})
    _wait("B's lease", lambda: holders(daemon) == [f"slurm-job-{b}"], 30)
    slurm.cmd("scancel", b)
    slurm.wait_job(b, {"CANCELLED"})
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)

    # --comment=gpuswap:bare: a bare window, CUDA_VISIBLE_DEVICES from Slurm.
    c = sbatch(slurm, jobs, f"echo $CUDA_VISIBLE_DEVICES > {jobs}/c.txt", "--comment=gpuswap:bare")
    assert slurm.wait_job(c, {"COMPLETED", "FAILED"})["JobState"] == "COMPLETED"
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)
    assert (jobs / "c.txt").read_text().strip() == "0"
    windows = daemon.ctl_json("history", "--limit", "3")["windows"]
    assert [(w["profile"], w["kind"], w["outcome"]) for w in windows][-1] == ("bare", "bare", "closed")


def test_a_prolog_that_cannot_get_the_card_fails_the_job_with_the_reason(gpuswapd: Start, probe: Probe,
                                                                       slurm: Slurm, world: Stack,
                                                                       tmp_path: Path) -> None:
    world.use_model(llama.ensure_model(world.cache, "slow"))
    world.restart_resident()
    daemon = gpuswapd(resident__idle={"wait": "1s", "on_busy": "fail"})
    link(slurm, daemon)
    with resident_busy():
        job = sbatch(slurm, tmp_path, "true")
        # slurmd drains the node and slurmctld requeues the job held, with the Prolog's reason on it.
        found = _wait("the job held with the Prolog's reason", lambda: (j := slurm.job(job))["JobState"] == "PENDING"
                      and j.get("AdminComment", "").startswith("slurm-prolog:") and j, 60)
    assert "strata.service is busy" in found["AdminComment"], found
    assert "drain" in slurm.cmd("sinfo", "-h", "-N", "-o", "%T").stdout  # slurmd drained the node, as for any Prolog
    assert found["JobState"] == "PENDING" and "held" in found["Reason"], found
    assert daemon.status()["last"]["outcome"] == "refused"
    assert_resident_back(probe)


def test_a_hostile_job_name_or_a_bad_profile_fails_only_that_job(gpuswapd: Start, probe: Probe, slurm: Slurm,
                                                                tmp_path: Path) -> None:
    daemon = with_profiles(gpuswapd, probe, daemon={"linger": "0.5s"})
    link(slurm, daemon)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    # The job's name comes before Comment= on scontrol's line: it must not be read as the comment.
    a = sbatch(slurm, jobs, f"echo $CUDA_VISIBLE_DEVICES > {jobs}/a.txt", "--job-name=x Comment=gpuswap:Oops",
               "--comment=gpuswap:bare")
    assert slurm.wait_job(a, {"COMPLETED", "FAILED", "CANCELLED"})["JobState"] == "COMPLETED", slurm.job(a)
    assert (jobs / "a.txt").read_text().strip() == "0"
    daemon.wait_phase("IDLE", timeout=60)
    windows = daemon.ctl_json("history", "--limit", "1")["windows"]
    assert windows[-1]["profile"] == "bare" and windows[-1]["outcome"] == "closed"

    # A profile nobody has, and a name that is no profile: the job is cancelled, the node serves on.
    for comment, says in (("gpuswap:oops", "asks for profile 'oops', which gpuswapd instance default does not have"),
                          ("gpuswap:Bad!", "asks for profile 'Bad!' in its comment: not a profile name")):
        marker = jobs / f"ran-{comment[8:]}"
        job = sbatch(slurm, jobs, f"touch {marker}", f"--comment={comment}")
        # A failed Prolog would leave it PENDING (requeued, held) and the node drained.
        found = slurm.wait_job(job, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=60)
        assert found["JobState"] == "CANCELLED", found
        assert says in found.get("AdminComment", ""), found
        assert not marker.exists()  # none of the job ran
        states = slurm.cmd("sinfo", "-h", "-N", "-o", "%T").stdout.split()
        assert not any("drain" in state for state in states), states
    daemon.wait_phase("IDLE", timeout=60)
    assert_resident_back(probe)
    b = sbatch(slurm, jobs, "true")  # the node still takes jobs
    assert slurm.wait_job(b, {"COMPLETED", "FAILED", "CANCELLED"})["JobState"] == "COMPLETED"



def test_a_prolog_that_waits_past_its_bound_fails_the_job_and_keeps_the_node(gpuswapd: Start, probe: Probe,
                                                                              slurm: Slurm, tmp_path: Path) -> None:
    # The window stalls while it opens (as behind a long lease of another profile): the Prolog gives up
    # below PrologEpilogTimeout (20 s here: its bound is 15 s), before slurmd would kill it and drain the node.
    conf = slurm.conf.read_text()
    slurm.conf.write_text(conf.replace("PrologEpilogTimeout=120", "PrologEpilogTimeout=20"))
    slurm.cmd("scontrol", "reconfigure")
    try:
        assert re.search(r"^PrologEpilogTimeout\s*=\s*20$", slurm.cmd("scontrol", "show", "config").stdout, re.M)
        daemon = gpuswapd(env={"GPUSWAPD_FAILPOINT_DELAY": "BOOTING=60"})
        link(slurm, daemon)
        marker = tmp_path / "ran"
        job = sbatch(slurm, tmp_path, f"touch {marker}")
        found = slurm.wait_job(job, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=60)
        assert found["JobState"] == "CANCELLED", found
        says = "not ready within the Prolog's bound of 15s (20s of PrologEpilogTimeout less a margin)"
        assert says in found.get("AdminComment", ""), found
        assert not marker.exists()  # none of the job ran
        states = slurm.cmd("sinfo", "-h", "-N", "-o", "%T").stdout.split()
        assert not any("drain" in state for state in states), states
        assert f"slurm-job-{job}" not in holders(daemon)  # its acquire was withdrawn
    finally:
        slurm.conf.write_text(conf)
        slurm.cmd("scontrol", "reconfigure")
