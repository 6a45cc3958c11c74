"""Before an engine boots: the compile-cache check, the known-bad table, and the boots history."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuswapd.adapters.docker import DockerMount, RunSettings
from gpuswapd.checks import bootchecks, knownbad
from gpuswapd.checks.caches import compile_caches
from gpuswapd.checks.knownbad import Table, human_int, load_table, parse_rows
from gpuswapd.config import Config, parse_config
from gpuswapd.ctl.render import print_plan, print_status
from gpuswapd.errors import ConfigError
from gpuswapd.parts.engineview import EngineView, Mount, from_config, from_container, under_image
from gpuswapd.record import Finished
from gpuswapd.window.price import Times, boot_took
from tests.unit.conftest import MINIMAL

SEED = "dflash-tokens-above-7-at-20k"
CACHE_VOLUME = '"/var/cache/hq" = "/cache"'


def config(container: str = "", window: str = "", extra: str = "") -> Config:
    """MINIMAL with more keys in [window.container] and [window]."""
    text = MINIMAL.replace('image = "hyperqwen:latest"', 'image = "hyperqwen:latest"\n' + container)
    text = text.replace('health_url = "http://127.0.0.1:18020/health"',
                        'health_url = "http://127.0.0.1:18020/health"\n' + window)
    return parse_config(text + extra)


def shipped() -> Table:
    return load_table(directory=Path("/nonexistent"))


def checked(cfg: Config, table: Table | None = None) -> bootchecks.ProfileCheck:
    [found] = bootchecks.check_config(cfg, table or shipped())
    return found


class Lines:
    """A logger that keeps what it is told (structlog's own capture misses a logger cached earlier)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "level": "info", **fields})

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "level": "warning", **fields})


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- compile caches ---------------------------------------------------------------------------


def test_a_container_without_any_cache_volume_warns_and_names_what_to_mount() -> None:
    found = checked(config('volumes = { "/opt/models" = "/models:ro" }'))
    warning = found.cache_warning()
    assert warning is not None
    for named in ("VLLM_CACHE_ROOT (/root/.cache/vllm)", "TORCHINDUCTOR_CACHE_DIR (/tmp/torchinductor_root)",
                  "TRITON_CACHE_DIR (/root/.triton/cache)", "FLASHINFER_WORKSPACE_BASE (/root/.cache/flashinfer)",
                  "about 3 minutes", "about 1 minute", "window.container.volumes"):
        assert named in warning, named
    assert warning in found.warnings()
    assert not any(c.kept for c in found.caches)


def test_a_volume_for_vllm_cache_root_silences_the_warning() -> None:
    found = checked(config(f'env = {{ VLLM_CACHE_ROOT = "/cache/vllm" }}\nvolumes = {{ {CACHE_VOLUME} }}'))
    assert found.cache_warning() is None and found.warnings() == []
    by_variable = {c.variable: c for c in found.caches}
    assert by_variable["VLLM_CACHE_ROOT"].on_volume and by_variable["VLLM_CACHE_ROOT"].path == "/cache/vllm"
    # vLLM keeps Inductor's cache inside its own; Triton's and FlashInfer's lie elsewhere (plan shows it).
    assert by_variable["TORCHINDUCTOR_CACHE_DIR"].kept and by_variable["TORCHINDUCTOR_CACHE_DIR"].inside
    assert not by_variable["TRITON_CACHE_DIR"].kept and not by_variable["FLASHINFER_WORKSPACE_BASE"].kept


def test_the_default_cache_root_under_a_mounted_home_cache_counts() -> None:
    found = checked(config('volumes = { "/var/cache/hq" = "/root/.cache" }'))
    assert found.cache_warning() is None
    assert {c.variable for c in found.caches if c.on_volume} == {"VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE"}


def test_a_read_only_cache_mount_keeps_nothing() -> None:
    found = checked(config('volumes = { "/var/cache/hq" = "/root/.cache:ro" }'))
    warning = found.cache_warning()
    assert warning is not None and "(mounted read-only)" in warning


def test_an_existing_container_keeps_its_own_filesystem_and_is_not_checked() -> None:
    found = checked(config('create = false\nenv = { DFLASH_TOKENS = "15", MAX_MODEL_LEN = "32768" }'))
    assert found.cache_warning() is None
    # gpuswapd starts it as it is: what the configuration says of its settings is not what it runs with.
    assert found.matches == [] and found.view.env == {}


def test_cache_paths_follow_home_xdg_and_a_non_root_user() -> None:
    view = EngineView("img", {"HOME": "/home/vllm", "XDG_CACHE_HOME": "/xdg", "USER": "vllm"}, [], user="1000")
    paths = {c.variable: c.path for c in compile_caches(view)}
    assert paths == {"VLLM_CACHE_ROOT": "/xdg/vllm", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_vllm",
                     "TRITON_CACHE_DIR": "/home/vllm/.triton/cache",
                     "FLASHINFER_WORKSPACE_BASE": "/home/vllm/.cache/flashinfer"}
    unknown = {c.variable: c.path for c in compile_caches(EngineView("img", {}, [], user="vllm"))}
    assert unknown["VLLM_CACHE_ROOT"] is None and unknown["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/torchinductor_vllm"
    home = EngineView("img", {"VLLM_CACHE_ROOT": "~/vc"}, [], mounts=(Mount("/root", "v", True, True),))
    assert compile_caches(home)[0].path == "/root/vc" and compile_caches(home)[0].on_volume


def test_docker_tells_the_image_environment_and_an_existing_containers_mounts() -> None:
    cfg = config('command = ["--max-model-len", "32768"]')
    view = from_config(cfg.window.container, {})
    image = RunSettings("hyperqwen:latest", {"DFLASH_TOKENS": "15", "HOME": "/root"}, ["vllm", "serve"],
                        ["--ignored"], "")
    seen = under_image(view, image)
    assert seen.argv == ["vllm", "serve", "--max-model-len", "32768"] and seen.env["DFLASH_TOKENS"] == "15"
    assert [m.row.id for m in shipped().matches(seen.image, seen.env, seen.argv)] == [SEED]
    existing = RunSettings("hq:1", {"VLLM_CACHE_ROOT": "/c"}, ["/entry"], ["--x"], "",
                           [DockerMount("tmpfs", "", "/c", True), DockerMount("volume", "hqcache", "/d", True)])
    container = from_container(view, existing)
    assert container.argv == ["/entry", "--x"] and container.image == "hq:1"
    assert container.mount_of("/c/vllm") == Mount("/c", "", True, False)  # a tmpfs keeps nothing
    assert container.mount_of("/d/x") is not None and container.mount_of("/d/x").persistent  # type: ignore[union-attr]


# --- the known-bad table ----------------------------------------------------------------------


@pytest.mark.parametrize(("container", "matches"), [
    ('env = { DFLASH_TOKENS = "15" }\ncommand = ["--max-model-len", "32768"]', True),
    ('env = { DFLASH_TOKENS = "15" }\ncommand = ["--max-model-len=32768"]', True),
    ('env = { DFLASH_TOKENS = "15", MAX_MODEL_LEN = "32k" }', True),
    ('env = { DFLASH_TOKENS = "15" }\ncommand = ["--max_model_len", "20000"]', True),
    ('env = { DFLASH_TOKENS = "7" }\ncommand = ["--max-model-len", "32768"]', False),
    ('env = { DFLASH_TOKENS = "15" }\ncommand = ["--max-model-len", "8192"]', False),
    ('env = { DFLASH_TOKENS = "15", MAX_MODEL_LEN = "8192" }', False),
    ('command = ["--max-model-len", "32768"]', False),
])
def test_the_seed_row_matches_a_long_draft_block_at_a_long_context_only(container: str, matches: bool) -> None:
    found = checked(config(container + f"\nvolumes = {{ {CACHE_VOLUME.replace('/cache', '/root/.cache')} }}"))
    assert [m.row.id for m in found.matches] == ([SEED] if matches else [])
    if matches:
        [warning] = found.warnings()
        assert SEED in warning and "DFLASH_TOKENS=15" in warning and "marlin_gemm" in warning
        assert 'window.allow_known_bad = ["dflash-tokens-above-7-at-20k"]' in warning
        assert found.refusals() == []  # the shipped row warns; it does not refuse


def test_an_unset_context_is_the_models_own_maximum_a_likely_match() -> None:
    [m] = shipped().matches("hq", {"DFLASH_TOKENS": "15"}, [])
    assert not m.certain and "vLLM takes the model's own maximum" in m.detail()


def test_allow_known_bad_silences_its_row_and_is_logged_at_start() -> None:
    cfg = config('env = { DFLASH_TOKENS = "15" }\ncommand = ["--max-model-len", "32768"]',
                 f'allow_known_bad = ["{SEED}"]')
    found = checked(cfg)
    assert found.matches == [] and not any(SEED in w for w in found.warnings())
    assert [(row_id, m is not None) for row_id, m in found.allowed] == [(SEED, True)]
    lines = Lines()
    bootchecks.log_check(found, lines)
    [allowed] = [e for e in lines.events if e["event"] == "known_bad_allowed"]
    assert allowed["row"] == SEED and allowed["key"] == "window.allow_known_bad" and allowed["matched"]


def test_allow_known_bad_is_per_profile_and_an_unknown_id_warns() -> None:
    engine = ('[profiles.eval]\nkind = "engine"\nhealth_url = "http://127.0.0.1:18021/health"\n'
              'allow_known_bad = ["no-such-row"]\n'
              '[profiles.eval.container]\nname = "eval"\nimage = "eval:1"\n'
              'env = { DFLASH_TOKENS = "9", MAX_MODEL_LEN = "65536" }\n'
              '[profiles.eval.verify]\nurl = "http://127.0.0.1:18021/v1/chat/completions"\nmodel = "eval"\n')
    cfg = config('env = { DFLASH_TOKENS = "15", MAX_MODEL_LEN = "32768" }', f'allow_known_bad = ["{SEED}"]',
                 extra=engine)
    window, evals = bootchecks.check_config(cfg, shipped())
    assert window.matches == [] and [m.row.id for m in evals.matches] == [SEED]
    assert any(w.startswith("profiles.eval: known-bad setting") for w in evals.warnings())
    assert any("profiles.eval.allow_known_bad: no known-bad row has the id 'no-such-row'" in w
               for w in evals.warnings())


REFUSING = """
[[row]]
id = "draft-15-refused"
env = { DFLASH_TOKENS = ">= 15" }
reason = "EngineDeadError at any context on this box"
source = "our own crash, 2025-06-01"
refuse = true
"""


def test_a_refusing_row_exits_78_naming_the_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str], daemon: ModuleType) -> None:
    rows = tmp_path / "known-bad.d"
    write(rows / "local.toml", REFUSING)
    monkeypatch.setenv("GPUSWAPD_KNOWN_BAD_DIR", str(rows))
    path = write(tmp_path / "gpuswapd.toml", MINIMAL.replace('image = "hyperqwen:latest"',
                                                             'image = "hyperqwen:latest"\n'
                                                             'env = { DFLASH_TOKENS = "15" }'))
    assert daemon.main(["--config", str(path), "--check-config"]) == daemon.EX_CONFIG
    err = capsys.readouterr().err
    assert "known-bad setting draft-15-refused refuses this engine (DFLASH_TOKENS=15)" in err
    assert 'window.allow_known_bad = ["draft-15-refused"]' in err
    # The same at start, from what the engine says it runs with.
    d = daemon.Daemon(parse_config(path.read_text()), known_bad=load_table())
    with pytest.raises(ConfigError, match="draft-15-refused refuses this engine"):
        asyncio.run(d._check_engines(ask_docker=False))
    # Allowed, it starts and --check-config passes.
    allowed = write(tmp_path / "allowed.toml", path.read_text().replace(
        'health_url = "http://127.0.0.1:18020/health"',
        'health_url = "http://127.0.0.1:18020/health"\nallow_known_bad = ["draft-15-refused"]'))
    assert daemon.main(["--config", str(allowed), "--check-config"]) == 0
    asyncio.run(daemon.Daemon(parse_config(allowed.read_text()), known_bad=load_table())._check_engines(False))


def test_a_refusing_row_only_warns_while_the_context_is_unknown() -> None:
    row = REFUSING.replace('reason =', 'context = "> 16384"\nreason =')
    table = Table(tuple(parse_rows(row, "local.toml")))
    found = checked(config('env = { DFLASH_TOKENS = "15" }'), table)
    assert found.refusals() == [] and any("refuses to start (refuse = true) once the context" in w
                                          for w in found.warnings())
    found = checked(config('env = { DFLASH_TOKENS = "15" }\ncommand = ["--max-model-len", "32K"]'), table)
    assert len(found.refusals()) == 1


def test_an_operators_own_rows_are_read_after_the_shipped_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        daemon: ModuleType) -> None:
    rows = tmp_path / "known-bad.d"
    write(rows / "10-site.toml", """
[[row]]
id = "big-batch"
image = "hyperqwen:*"
args = { "--max-num-seqs" = "> 64", "--enforce-eager" = false }
reason = "OOM in CUDA graph capture"
source = "site runbook"
refuse = false
""")
    write(rows / "20-override.toml", f"""
[[row]]
id = "{SEED}"
env = {{ DFLASH_TOKENS = "> 7" }}
reason = "refused here at any context"
source = "site policy"
refuse = true
""")
    write(rows / "notes.txt", "not a row file")
    monkeypatch.setenv("GPUSWAPD_KNOWN_BAD_DIR", str(rows))
    table = load_table()
    assert table.ids == [SEED, "big-batch"] and table.files[1:] == (str(rows / "10-site.toml"),
                                                                       str(rows / "20-override.toml"))
    assert next(r for r in table.rows if r.id == SEED).refuse  # the operator's row replaced the shipped one
    path = write(tmp_path / "gpuswapd.toml", MINIMAL.replace(
        'image = "hyperqwen:latest"', 'image = "hyperqwen:latest"\ncommand = ["--max-num-seqs", "128"]'))
    assert daemon.main(["--config", str(path), "--check-config"]) == 0
    err = capsys.readouterr().err
    assert "known-bad setting big-batch (image hyperqwen:latest, --max-num-seqs 128, no --enforce-eager)" in err
    eager = write(tmp_path / "eager.toml", path.read_text().replace('"128"]', '"128", "--enforce-eager"]'))
    assert daemon.main(["--config", str(eager), "--check-config"]) == 0
    assert "big-batch" not in capsys.readouterr().err


def test_two_operator_files_with_one_id_exit_78(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = tmp_path / "d"
    write(rows / "a.toml", REFUSING)
    write(rows / "b.toml", REFUSING)
    monkeypatch.setenv("GPUSWAPD_KNOWN_BAD_DIR", str(rows))
    with pytest.raises(ConfigError, match=r"b\.toml: row id 'draft-15-refused' is also a row of .*a\.toml"):
        load_table()


@pytest.mark.parametrize(("text", "names"), [
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nenv = { A = '> seven' }", "row[0] (x).env.A"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nenv = { A = 7 }", "row[0] (x).env.A"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nenv = { A = '=> 7' }", "row[0] (x).env.A"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = 'yes'\nimage = '*'", "row[0] (x).refuse"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false", "row[0] (x): matches every engine"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nrefuse = false\nimage = '*'", "row[0].source: missing"),
    ("[[row]]\nid = 'X Y'\nreason = 'r'\nsource = 's'\nrefuse = false\nimage = '*'", "row[0].id"),
    ("[[row]]\nid = 'x'\nreason = ''\nsource = 's'\nrefuse = false\nimage = '*'", "row[0] (x).reason"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nimage = '*'\nrefuses = true",
     "row[0].refuses: unknown key"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nargs = { 'max-num-seqs' = '> 1' }",
     "row[0] (x).args.max-num-seqs"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\ncontext = 'big*'", "row[0] (x).context"),
    ("[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nimage = '*'\n"
     "[[row]]\nid = 'x'\nreason = 'r'\nsource = 's'\nrefuse = false\nimage = '*'", "row[1].id"),
    ("[rows]\nid = 'x'", "rows: unknown key"),
    ("[[row]\nid = 'x'", "not valid TOML"),
])
def test_a_malformed_row_file_exits_78_naming_the_file_and_the_key(
        text: str, names: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], daemon: ModuleType) -> None:
    rows = tmp_path / "known-bad.d"
    bad = write(rows / "bad.toml", text)
    monkeypatch.setenv("GPUSWAPD_KNOWN_BAD_DIR", str(rows))
    path = write(tmp_path / "gpuswapd.toml", MINIMAL)
    assert daemon.main(["--config", str(path), "--check-config"]) == daemon.EX_CONFIG
    err = capsys.readouterr().err
    assert f"{bad}: {names}" in err, err
    assert daemon.main(["--config", str(path)]) == daemon.EX_CONFIG  # the start, too, before anything else


def test_an_unreadable_shipped_table_exits_78_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        daemon: ModuleType) -> None:
    monkeypatch.setenv("GPUSWAPD_KNOWN_BAD", str(tmp_path / "gone.toml"))
    assert daemon.main(["--config", str(write(tmp_path / "g.toml", MINIMAL)), "--check-config"]) == daemon.EX_CONFIG
    assert f"{tmp_path / 'gone.toml'}: cannot read the known-bad table" in capsys.readouterr().err


def test_the_package_ships_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    packaged = Path(knownbad.__file__).parents[1] / knownbad.PACKAGE_DATA  # gpuswapd/data
    assert next(r.id for r in parse_rows(packaged.read_text(), str(packaged))) == SEED
    monkeypatch.delenv("GPUSWAPD_KNOWN_BAD")  # then /usr/share/gpuswapd/known-bad.toml, else the package's
    name, text = knownbad.shipped_source()
    assert name in (str(knownbad.SHIPPED), str(packaged)) and SEED in knownbad.Table(
        tuple(parse_rows(text, name))).ids


def test_command_line_options_and_human_readable_contexts() -> None:
    argv = ["--a", "1", "--b=2", "--flag", "--c", "--a", "3", "-tp", "2"]
    assert knownbad.arg_value(argv, "--a") == (True, "3")  # the last one counts
    assert knownbad.arg_value(argv, "--b") == (True, "2")
    assert knownbad.arg_value(argv, "--flag") == (True, None)
    assert knownbad.arg_value(argv, "--c") == (True, None)
    assert knownbad.arg_value(argv, "-tp") == (True, "2")
    assert knownbad.arg_value(argv, "--d") == (False, None)
    assert [human_int(t) for t in ("32768", "32k", "32K", "1.5m", "1M", "big", "")] == [
        32768, 32000, 32768, 1_500_000, 1 << 20, None, None]
    assert knownbad.max_context({"MAX_MODEL_LEN": "9"}, ["--max-model-len", "12"]) == (12, "--max-model-len")


# --- boots in history and status ------------------------------------------------------------


def _window(profile: str, booting: float | None, warmed: bool = True, start: str = "cold") -> dict[str, Any]:
    timings: list[dict[str, Any]] = [{"phase": "DRAINING", "stage": "open", "started_at": 0.0, "took_s": 0.1}]
    if booting is not None:
        timings.append({"phase": "BOOTING", "stage": "open", "started_at": 1.0, "took_s": booting})
    else:
        timings.append({"phase": "WAKING", "stage": "open", "started_at": 1.0, "took_s": 2.0})
    if warmed and booting is not None:
        timings.append({"phase": "WARMING", "stage": "open", "started_at": 2.0, "took_s": 5.0})
    timings.append({"phase": "READY", "stage": "open", "started_at": 9.0, "took_s": 60.0})
    return {"profile": profile, "start": start, "opened_at": 0.0, "outcome": "closed", "timings": timings}


def test_history_keeps_each_boot_to_healthy_per_profile_the_last_two_and_the_longest() -> None:
    times = Times()
    for record in (_window("default", 181.0), _window("default", 62.5), _window("eval", 30.0),
                   _window("default", None, start="warm"), _window("default", 500.0, warmed=False),
                   _window("default", 58.25)):
        times.learn(Finished.from_dict(record))
    assert times.boots() == {"default": {"last_s": [58.25, 62.5], "longest_s": 181.0, "count": 3},
                             "eval": {"last_s": [30.0], "longest_s": 30.0, "count": 1}}
    assert boot_took(Finished.from_dict(_window("default", None))) is None  # woken from park: no boot
    assert boot_took(Finished.from_dict(_window("default", 500.0, warmed=False))) is None  # never healthy


def test_status_and_plan_print_boots_caches_and_warnings() -> None:
    out = io.StringIO()
    print_status({"phase": "IDLE", "boots": {"default": {"last_s": [58.25, 62.5], "longest_s": 181.0,
                                                          "count": 3}}}, out)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("boot"))
    assert line == "boot to healthy, profile default: last 58.2s, 62.5s; longest 181.0s (of 3 boots)"
    assert "warm" not in line and "cold" not in line
    found = checked(config())
    plan = {"units": [], "timers": [], "jobs_running": [], "resident_busy": None, "container": None,
            "problems": [], "ok": True, "warnings": found.warnings(), "settings": found.to_dict()}
    out = io.StringIO()
    print_plan(plan, out)
    text = out.getvalue()
    assert "compile cache: VLLM_CACHE_ROOT /root/.cache/vllm not kept" in text
    assert "warning:       window.container keeps no compile cache on a volume" in text
