"""Before the engine boots, on the test world: its compile caches, the known-bad table, its boots in status."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import TEST_BOOT_DELAY
from tests.stack.config import ENGINE_ENV
from tests.stack.daemon import RunningDaemon
from tests.stack.probe import Probe
from tests.stack.world import ENGINE_IMAGE, Stack

Start = Callable[..., RunningDaemon]
SEED = "dflash-tokens-above-7-at-20k"


def no_rows(tmp_path: Path) -> dict[str, str]:
    """The daemon's environment for the shipped table alone (never the host's /etc/gpuswapd/known-bad.d)."""
    return {"GPUSWAPD_KNOWN_BAD_DIR": str(tmp_path / "no-rows")}


def container(world: Stack, **changes: Any) -> dict[str, Any]:
    """The world's engine container (as tests/stack/config.py has it), with ``changes``."""
    base: dict[str, Any] = {"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": TEST_BOOT_DELAY},
                            "volumes": {"/usr": "/usr:ro", str(world.paths.gpu): "/gpu"}}
    for key, value in changes.items():
        base[key] = {**base[key], **value}
    return base


def test_plan_names_the_compile_cache_warning_for_the_worlds_engine(gpuswapd: Start, probe: Probe,
                                                                    tmp_path: Path) -> None:
    daemon = gpuswapd(env=no_rows(tmp_path))
    before = probe.snapshot()
    plan = daemon.ctl_json("plan")["plan"]
    [warning] = [w for w in plan["warnings"] if "keeps no compile cache" in w]
    assert warning.startswith("window.container keeps no compile cache on a volume: VLLM_CACHE_ROOT "
                              "(/root/.cache/vllm)")
    assert "TRITON_CACHE_DIR (/root/.triton/cache)" in warning and "about 3 minutes" in warning
    assert plan["ok"] and plan["problems"] == []  # a warning: the window would still open
    # Docker answered: the image's own settings were read (its CMD is the simulated engine).
    assert plan["settings"]["from"] == "the configuration and the image"
    assert [c["kept"] for c in plan["settings"]["caches"]] == [False] * 4
    human = daemon.ctl("plan")
    assert human.returncode == 0
    assert "warning:       window.container keeps no compile cache" in human.stdout
    assert "compile cache: VLLM_CACHE_ROOT /root/.cache/vllm not kept" in human.stdout
    after = probe.snapshot()
    for key in ("units", "timers", "containers", "ooms"):
        assert before[key] == after[key]
    # The start said so too.
    assert [e["profile"] for e in daemon.logged("compile_cache_not_kept")] == ["default"]


def test_a_cache_volume_silences_it_and_a_known_bad_setting_is_named(gpuswapd: Start, world: Stack,
                                                                     tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    daemon = gpuswapd(env=no_rows(tmp_path), window__container=container(
        world, env={"VLLM_CACHE_ROOT": "/cache/vllm", "DFLASH_TOKENS": "15", "MAX_MODEL_LEN": "32768"},
        volumes={str(cache): "/cache"}))
    plan = daemon.ctl_json("plan")["plan"]
    assert not any("compile cache" in w for w in plan["warnings"])
    [warning] = plan["warnings"]
    assert warning.startswith(f"window: known-bad setting {SEED} (DFLASH_TOKENS=15, context 32768 (MAX_MODEL_LEN))")
    assert plan["settings"]["known_bad"] == [{"id": SEED, "refuse": False, "certain": True,
                                              "matched": "DFLASH_TOKENS=15, context 32768 (MAX_MODEL_LEN)"}]
    assert [e["row"] for e in daemon.logged("known_bad_setting")] == [SEED]


def test_a_refusing_row_of_the_operator_keeps_gpuswapd_from_starting(gpuswapd: Start, probe: Probe,
                                                                    tmp_path: Path) -> None:
    rows = tmp_path / "known-bad.d"
    rows.mkdir()
    (rows / "world.toml").write_text(f"""
[[row]]
id = "sim-refused"
image = "{ENGINE_IMAGE.partition(':')[0]}:*"
env = {{ ENGINE_TOKENS_PER_CHUNK = ">= 3" }}
reason = "a test's refusal"
source = "tests/integration/test_knownbad.py"
refuse = true
""")
    before = probe.snapshot()
    daemon = gpuswapd(wait=False, env={"GPUSWAPD_KNOWN_BAD_DIR": str(rows)})
    assert daemon.proc is not None
    assert daemon.proc.wait(30) == 78
    log = daemon.log.read_text()
    assert "known-bad setting sim-refused refuses this engine (image hyperqwen-sim:latest, " \
           "ENGINE_TOKENS_PER_CHUNK=3)" in log
    after = probe.snapshot()
    for key in ("units", "timers", "containers"):
        assert before[key] == after[key]
    assert not daemon.socket.exists()


def test_status_shows_each_boot_to_healthy_from_the_history(gpuswapd: Start, tmp_path: Path) -> None:
    daemon = gpuswapd(env=no_rows(tmp_path))
    for _ in range(2):
        assert daemon.ctl("acquire", "--for", "1m").returncode == 0
        daemon.ctl("release")
        daemon.wait_phase("IDLE")
    status = daemon.status()
    booted = [next(t["took_s"] for t in w["timings"] if t["phase"] == "BOOTING")
              for w in daemon.ctl_json("history", "--limit", "2")["windows"]]
    boots = status["boots"]["default"]
    assert boots["count"] == 2 and boots["last_s"] == [booted[-1], booted[-2]]
    assert boots["longest_s"] == max(booted) and min(booted) >= float(TEST_BOOT_DELAY)
    line = next(ln for ln in daemon.ctl("status").stdout.splitlines() if ln.startswith("boot to healthy"))
    assert line.startswith("boot to healthy, profile default: last ") and "(of 2 boots)" in line
    # A restarted gpuswapd learns them from the history.
    daemon.stop()
    daemon.start()
    assert daemon.status()["boots"]["default"] == boots
