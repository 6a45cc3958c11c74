import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuswapd.config import Config, load_config, parse_config
from gpuswapd.errors import ConfigError
from tests.unit.conftest import MINIMAL

SHIPPED = Path(__file__).resolve().parents[2] / "units" / "gpuswapd.toml"


def _fields(cls: type, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        if f.name in ("source", "profiles", "gateway_configured"):
            continue
        if "parse" in f.metadata:
            out.add(prefix + f.name)
        else:
            out |= _fields(typing.get_type_hints(cls)[f.name], f"{prefix}{f.name}.")
    return out


def shipped_parts() -> dict[str, str]:
    """The shipped file's parts by their title's first word, each uncommented from its first table on."""
    parts: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in SHIPPED.read_text().splitlines():
        if title := re.match(r"^# ==== (\S+)", line):
            lines = parts.setdefault(title.group(1).rstrip(":,"), [])
        elif lines is not None and (lines or line.startswith("# [")):
            assert line.startswith("# ") or line in ("#", ""), f"not a commented line: {line!r}"
            lines.append(line[2:])
    return {title: "\n".join(lines) + "\n" for title, lines in parts.items()}


def _leaves(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict) and key not in ("env", "ports", "volumes"):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def _field(dotted: str) -> dataclasses.Field[Any]:
    cls: Any = Config
    *tables, key = dotted.split(".")
    for table in tables:
        cls = typing.get_type_hints(cls)[table]
    return next(f for f in dataclasses.fields(cls) if f.name == key)


def test_the_shipped_configuration_sets_nothing_and_gpuswapd_says_what_to_set(
        daemon: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert all(line.startswith("#") or not line.strip() for line in SHIPPED.read_text().splitlines())
    for source in (SHIPPED, "<empty>"):
        with pytest.raises(ConfigError) as err:
            load_config(SHIPPED) if source == SHIPPED else parse_config("", source)
        [line] = err.value.message.splitlines()  # one line, not every key it lacks
        assert line.startswith(f"{source}: resident: not configured"), line
        assert "resident.units" in line and "resident.verify.url" in line and "gpuswapd.toml(5)" in line
    assert daemon.main(["--config", str(SHIPPED)]) == daemon.EX_CONFIG  # it does not start
    assert daemon.main(["--config", str(SHIPPED), "--check-config"]) == daemon.EX_CONFIG
    assert capsys.readouterr().err.count(f"gpuswapd: {SHIPPED}: resident: not configured") == 2
    # A file that names the resident but lacks a key is told each key, as before.
    with pytest.raises(ConfigError, match=r"resident\.verify\.model: missing"):
        parse_config(MINIMAL.replace('model = "strata"', ""))


def test_the_shipped_configuration_names_every_key_at_its_default() -> None:
    parts = shipped_parts()
    assert list(parts) == ["Example", "Every", "gpuswapd-gateway", "Other"]
    reference = parts["Every"] + parts["gpuswapd-gateway"]
    shown = _leaves(tomllib.loads(reference))
    assert set(shown) == _fields(Config), "keys the shipped file lacks (or names but gpuswapd does not know)"
    lines, table = {}, ""
    for line in reference.splitlines():
        if header := re.match(r"^\[([\w.-]+)\]", line):
            table = header.group(1)
        elif key := re.match(r"^(\w+) = ", line):
            lines[f"{table}.{key.group(1)}"] = line
    for key, value in shown.items():
        f = _field(key)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert "# required" in lines[key], f"{key} has no default: mark it required"
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert f.metadata["parse"](value, key) == default, f"{key} is shown at {value!r}, not at its default"


def test_the_shipped_example_is_a_whole_setup_and_so_are_its_profiles() -> None:
    parts = shipped_parts()
    config = parse_config(parts["Example"], "example")
    assert config.resident.units == ["strata.service"] and config.resident.server == "llama.cpp"
    assert config.timers.pause == ["agent-*.timer"]
    assert config.window.container.ports == {"8000/tcp": 18020}
    assert config.window.container.env_file == "/etc/gpuswapd/hyperqwen.env"
    assert config.gpu.window_needs == 21 * 2**30
    with_profiles = parse_config(parts["Example"] + parts["Other"], "example")
    assert [p.name for p in with_profiles.all_profiles()] == ["default", "bare", "qwen-eval"]


def test_minimal_config_takes_defaults() -> None:
    config = parse_config(MINIMAL)
    assert config.daemon.socket == "/run/gpuswapd/gpuswapd.sock"
    assert config.daemon.linger == 30
    assert config.window.container.create is True
    assert config.timers.pause == []


@pytest.mark.parametrize(("patch", "names"), [
    ("[daemon]\nlingr = '30s'", "daemon.lingr: unknown key"),
    ("[daemon]\nlinger = '30 parsecs'", "daemon.linger"),
    ("[daemon]\nlinger = true", "daemon.linger"),
    ("[daemon]\nmax_lease = '-5m'", "daemon.max_lease"),
    ("[daemon]\nmax_lease = 'infinity'", "daemon.max_lease"),
    ("[daemon]\non_shutdown = 'explode'", "daemon.on_shutdown"),
    ("[daemon]\nresidency_factor = -1", "daemon.residency_factor"),
    ("[daemon]\nresidency_factor = 'four'", "daemon.residency_factor"),
    ("[daemon]\nreclaim_grace = 'soon'", "daemon.reclaim_grace"),
    ("[gpu]\nwindow_needs = '21 parsecs'", "gpu.window_needs"),
    ("[gpu]\nprobe = 'cuda'", "gpu.probe"),
    ("[gpu]\nindex = -1", "gpu.index"),
    ("[timers]\npause = 'agent-*.timer'", "timers.pause"),
    ("[timers]\npause = ['agent-*.service']", "timers.pause[0]"),
    ("[window.warmup]\nrequests = '3'", "window.warmup.requests"),
    ("[window.container.env]\nSPEC = 1", "window.container.env.SPEC"),
    ("[window.container.ports]\n'http' = 18020", "window.container.ports.http"),
    ("[surprise]\nx = 1", "surprise: unknown key"),
    ("[resident.cache]\nkeep = 'yes'", "resident.cache.keep"),
    ("[resident.cache]\nsave_path = 'slots'", "resident.cache.save_path"),
    ("[resident.cache]\nslots_url = '127.0.0.1:8081/slots'", "resident.cache.slots_url"),
    ("[resident.cache]\nsave_timeout = '0'", "resident.cache.save_timeout"),
    ("[resident.cache]\nmax_size = 'lots'", "resident.cache.max_size"),
])
def test_bad_values_name_the_key(patch: str, names: str) -> None:
    # Tables may not be declared twice in TOML, so merge the patch into the minimal config.
    text = MINIMAL
    header = patch.split("\n", 1)[0]
    if header in text:
        text = text.replace(header, patch)
    else:
        text += "\n" + patch
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        parse_config(text, "test.toml")


def test_missing_image_names_it() -> None:
    with pytest.raises(ConfigError, match=r"window\.container\.image: missing"):
        parse_config(MINIMAL.replace('image = "hyperqwen:latest"', ""))


def test_a_file_with_three_errors_names_all_three_each_by_its_key() -> None:
    text = (MINIMAL.replace('image = "hyperqwen:latest"', "")  # missing
            .replace("[window]\n", "[window]\nboot_timeout = 'ten minutes'\n")  # a bad value
            + "[daemon]\nlingr = '1s'\n")  # a typo: an unknown key
    with pytest.raises(ConfigError) as err:
        parse_config(text, "three.toml")
    lines = err.value.message.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["window.container.image", "daemon.lingr",
                                                       "window.boot_timeout"], lines
    assert all(line.startswith("three.toml: ") for line in lines)


def test_check_config_of_either_program_prints_every_error_a_line_and_exits_78(
        tmp_path: Path, daemon: ModuleType, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuswapd.gateway import main as gateway

    monkeypatch.setattr(gateway, "setup_logging", lambda *args, **kwargs: None)  # as the daemon fixture does
    path = tmp_path / "three.toml"
    path.write_text(MINIMAL.replace('model = "strata"', "model = 7") + "[gpu]\nwindow_needs = 'lots'\n"
                    "[metrics]\nx = 1\n")
    for program, main in (("gpuswapd", daemon.main), ("gpuswapd-gateway", gateway.main)):
        assert main(["--config", str(path), "--check-config"]) == 78
        lines = capsys.readouterr().err.splitlines()
        assert [line.split(": ")[2] for line in lines] == ["gpu.window_needs", "resident.verify.model", "metrics.x"]
        assert all(line.startswith(f"{program}: {path}: ") for line in lines), lines


def test_every_relation_between_keys_is_named_once_every_key_is_valid() -> None:
    relations = MINIMAL + "[daemon]\ndefault_lease = '5h'\npriority_min_nonroot = 5\nmax_clients_per_uid = 600\n"
    with pytest.raises(ConfigError) as err:
        parse_config(relations, "r.toml")
    assert [line.split(": ")[1] for line in err.value.message.splitlines()] == [
        "daemon.default_lease", "daemon.priority_min_nonroot", "daemon.max_clients_per_uid"]
    # A key that is itself wrong is named alone: a relation with a value it may not have means nothing.
    with pytest.raises(ConfigError) as err:
        parse_config(relations.replace("max_clients_per_uid = 600", "max_clients_per_uid = 0"), "r.toml")
    assert [line.split(": ")[1] for line in err.value.message.splitlines()] == ["daemon.max_clients_per_uid"]


def test_every_profile_is_checked_and_each_error_named() -> None:
    text = MINIMAL + "[gpu]\nprobe = 'none'\n[profiles.Bad]\nkind = 'bare'\n[profiles.x]\nkind = 'vm'\n" \
        "[profiles.y]\nkind = 'engine'\nhealth_url = 'http://127.0.0.1:18021/health'\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, "p.toml")
    named = [line.split(": ")[1] for line in err.value.message.splitlines()]
    assert named == ["profiles.y.container.name", "profiles.y.container.image", "profiles.y.verify.url",
                     "profiles.y.verify.model", "profiles.Bad", "profiles.x.kind"], named


def test_default_lease_longer_than_max() -> None:
    with pytest.raises(ConfigError, match="default_lease"):
        parse_config(MINIMAL + "\n[daemon]\ndefault_lease = '5h'\n")


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("[daemon\n", "x.toml")
    with pytest.raises(ConfigError, match="no such configuration file"):
        load_config(tmp_path / "nope.toml")


def test_park_sleep_needs_a_gpu_probe() -> None:
    text = MINIMAL + '[gpu]\nprobe = "none"\n[window.park]\nmode = "sleep"\n'
    with pytest.raises(ConfigError, match=r"window.park.mode: \"sleep\" needs a GPU probe"):
        parse_config(text)


def test_park_keys_are_checked() -> None:
    for patch, names in (('mode = "nap"', "window.park.mode"), ("level = 3", "window.park.level"),
                         ('keep = "soon"', "window.park.keep"),
                         ('host_ram_needs = "lots"', "window.park.host_ram_needs")):
        with pytest.raises(ConfigError, match=names):
            parse_config(MINIMAL + f"[window.park]\n{patch}\n")


def test_check_config_warns_about_an_engine_without_sleep_mode() -> None:
    from gpuswapd.config import warnings

    plain = parse_config(MINIMAL + '[window.park]\nmode = "sleep"\n')
    assert [w for w in warnings(plain) if "--enable-sleep-mode" in w or "VLLM_SERVER_DEV_MODE" in w] == warnings(plain)
    assert len(warnings(plain)) == 2
    ready = parse_config(MINIMAL.replace('image = "hyperqwen:latest"', 'image = "hyperqwen:latest"\n'
                                         'command = ["--enable-sleep-mode"]\nenv = { VLLM_SERVER_DEV_MODE = "1" }')
                         + '[window.park]\nmode = "sleep"\n')
    assert warnings(ready) == []
    assert warnings(parse_config(MINIMAL)) == []  # mode = "stop": nothing to say


@pytest.mark.parametrize(("patch", "names"), [
    ("[gateway]\nlisten = '8080'", "gateway.listen"),
    ("[gateway]\nresident = ''", "gateway.resident: must not be empty"),
    ("[gateway]\nresident = 'http://127.0.0.1:8090/v1/models'", "gateway.resident: not an http"),
    ("[gateway]\nidle = 'a while'", "gateway.idle"),
    ("[gateway]\nhold = '0s'", "gateway.hold"),
    ("[gateway]\non_resident_busy = 'cry'", "gateway.on_resident_busy"),
    ("[gateway]\nmax_body = 'big'", "gateway.max_body"),
    ("[gateway]\nmax_waiting = 0", "gateway.max_waiting"),
    ("[gateway]\nmax_bodies = 'lots'", "gateway.max_bodies"),
    ("[gateway]\nupstream_idle = '0.1s'", "gateway.upstream_idle"),
    ("[gateway]\nsurprise = 1", "gateway.surprise: unknown key"),
    ("[window]\nserves = 'hyperqwen'", "window.serves"),
    ("[window]\nserves = ['a', 'a']", r"window.serves\[1\]: 'a' is named twice"),
    ("[window]\nserves = ['strata']", "window.serves: 'strata' is also served by the resident"),
    ("[resident.idle]\nkind = 'gateway-ish'", "resident.idle.kind"),
])
def test_gateway_keys_name_the_key(patch: str, names: str) -> None:
    header = patch.partition("\n")[0]
    text = MINIMAL.replace(header, patch) if header in MINIMAL else MINIMAL + "\n" + patch
    with pytest.raises(ConfigError, match=names):
        parse_config(text, "test.toml")


def test_a_name_served_by_two_profiles_names_both() -> None:
    text = MINIMAL.replace('[window]\n', '[window]\nserves = ["hyperqwen"]\n') + """
[profiles.eval]
kind = "engine"
health_url = "http://127.0.0.1:18021/health"
serves = ["hyperqwen"]
[profiles.eval.container]
name = "qwen-eval"
image = "qwen-eval:latest"
[profiles.eval.verify]
url = "http://127.0.0.1:18021/v1/chat/completions"
model = "qwen-eval"
"""
    with pytest.raises(ConfigError, match=r"profiles.eval.serves: 'hyperqwen' is also served by window.serves "
                                          r"\(profile 'default'\)"):
        parse_config(text)


def test_the_resident_probes_must_bypass_the_gateway() -> None:
    # Without a [gateway] table nothing is checked: a box without the gateway keeps llama-swap on 8080.
    assert parse_config(MINIMAL).resident.verify.url.startswith("http://127.0.0.1:8080/")
    with pytest.raises(ConfigError, match=r"resident.verify.url: .* is the gateway's own address"):
        parse_config(MINIMAL + "[gateway]\n")
    with pytest.raises(ConfigError, match=r"resident.idle.url: .* is the gateway's own address"):
        parse_config(MINIMAL.replace(":8080/", ":8090/") + "[resident.idle]\nurl = 'http://localhost:8080/slots'\n"
                     "[gateway]\n")
    moved = parse_config(MINIMAL.replace(":8080/", ":8090/") + "[gateway]\n")
    assert moved.gateway.resident == "http://127.0.0.1:8090"
    assert moved.window.api_base == "http://127.0.0.1:18020"  # api defaults to verify.url's origin
    gateway_probe = parse_config(MINIMAL.replace(":8080/", ":8090/") + "[resident.idle]\nkind = 'gateway'\n"
                                 "[gateway]\nlisten = '127.0.0.1:8099'\n")
    assert gateway_probe.idle_probe().url == "http://127.0.0.1:8099/gpuswapd/in-flight"
