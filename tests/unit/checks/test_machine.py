"""What --check-config checks on this machine: the env files, the sizes against the card; the gateway's needs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpuswapd.adapters.gpu import VramReading
from gpuswapd.checks.machine import check_machine
from gpuswapd.config import gateway_problems, parse_config
from gpuswapd.errors import GpuProbeError
from tests.unit.conftest import MINIMAL, card_of

GiB = 1 << 30
CARD_24GB = 24 * GiB
EVAL = """
[profiles.eval]
kind = "engine"
health_url = "http://127.0.0.1:18021/health"
[profiles.eval.container]
name = "eval"
image = "eval:latest"
env_file = "{env_file}"
[profiles.eval.verify]
url = "http://127.0.0.1:18021/v1/chat/completions"
model = "eval"
[profiles.train]
kind = "bare"
needs = "{train_needs}"
"""


class Card:
    """A GPU probe that reads a card of ``total`` bytes, or fails, or hangs until told to go on."""

    def __init__(self, total: int = CARD_24GB, fails: str = "", hangs: bool = False) -> None:
        self.total, self.fails, self.hangs = total, fails, hangs
        self.go_on = threading.Event()

    def read(self, processes: bool = True) -> VramReading:
        if self.hangs:
            self.go_on.wait(10)
        if self.fails:
            raise GpuProbeError(self.fails)
        return VramReading(total_bytes=self.total, used_bytes=0, free_bytes=self.total, processes=())


@pytest.fixture
def hung() -> Iterator[Card]:
    card = Card(hangs=True)
    yield card
    card.go_on.set()


def with_keys(gpu: str = "", container: str = "", extra: str = "") -> str:
    text = MINIMAL.replace('image = "hyperqwen:latest"', 'image = "hyperqwen:latest"\n' + container)
    return text + (f"[gpu]\n{gpu}\n" if gpu else "") + extra


def test_an_env_file_that_is_missing_unreadable_or_garbled_is_an_error_naming_its_key(tmp_path: Path) -> None:
    good = tmp_path / "good.env"
    good.write_text("HF_TOKEN=x\n# a comment\n\nVLLM_LOGGING_LEVEL=INFO\n")
    garbled = tmp_path / "garbled.env"
    garbled.write_text("HF_TOKEN=x\nexport HF_HOME=/cache\n")
    assert check_machine(parse_config(with_keys(container=f'env_file = "{good}"')), Card()).errors == []
    for path, says in ((tmp_path / "absent.env", "No such file"), (tmp_path, "Is a directory"),
                       (garbled, "line 2")):
        errors = check_machine(parse_config(with_keys(container=f'env_file = "{path}"')), Card()).errors
        assert len(errors) == 1 and errors[0].startswith("window.container.env_file: "), errors
        assert says in errors[0] and str(path) in errors[0], errors
    both = parse_config(with_keys(container=f'env_file = "{garbled}"', extra=EVAL.format(
        env_file=tmp_path / "absent.env", train_needs="1GiB")))
    assert [e.split(": ")[0] for e in check_machine(both, Card()).errors] == [
        "window.container.env_file", "profiles.eval.container.env_file"]


def test_a_size_the_card_cannot_hold_is_an_error_naming_its_key() -> None:
    fits = parse_config(with_keys(extra=EVAL.format(env_file="", train_needs="20GiB")))
    assert check_machine(fits, Card()).errors == [] and check_machine(fits, Card()).warnings == []
    too_big = parse_config(with_keys('resident_needs = "200GiB"\nwindow_needs = "30GiB"',
                                     extra=EVAL.format(env_file="", train_needs="25GiB")))
    errors = check_machine(too_big, Card()).errors
    assert [e.split(": ")[0] for e in errors] == ["gpu.resident_needs", "gpu.window_needs", "profiles.train.needs"]
    assert "200.0 GiB is more than the card's 24.0 GiB (GPU 0)" in errors[0], errors
    assert check_machine(too_big, Card(total=256 * GiB)).errors == []


def test_a_card_that_cannot_be_read_leaves_the_sizes_unchecked_with_a_warning(hung: Card) -> None:
    too_big = parse_config(with_keys('resident_needs = "200GiB"\nprobe_timeout = "0.1s"'))
    for card, says in ((Card(fails="nvidia-smi failed"), "(nvidia-smi failed)"), (hung, "did not answer within 0.1s")):
        found = check_machine(too_big, card)
        assert found.errors == []
        [warning] = found.warnings
        assert warning.startswith("gpu: the card's memory cannot be read") and says in warning, warning
        assert "gpu.resident_needs (200.0 GiB)" in warning and "24 GB" not in warning, warning
    [defaults] = check_machine(parse_config(with_keys('probe = "none"')), None).warnings
    assert '(gpu.probe = "none")' in defaults and "the defaults, which assume a 24 GB card" in defaults, defaults


def test_check_config_reads_the_card_through_its_probe_and_exits_78(tmp_path: Path, daemon: ModuleType,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpuswapd.toml"
    gpu = card_of(tmp_path)  # 24 GB
    path.write_text(with_keys(gpu + 'resident_needs = "200GiB"', container=f'env_file = "{tmp_path}/absent.env"'))
    assert daemon.main(["--config", str(path), "--check-config"]) == daemon.EX_CONFIG
    err = capsys.readouterr().err
    assert "gpuswapd: gpu.resident_needs: 200.0 GiB is more than the card's 24.0 GiB" in err, err
    assert "gpuswapd: window.container.env_file: cannot read the env file" in err, err
    path.write_text(with_keys(gpu))
    assert daemon.main(["--config", str(path), "--check-config"]) == 0
    assert "cannot be read" not in capsys.readouterr().err


def test_the_gateway_needs_its_table_and_a_model_name_to_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuswapd.gateway import main as gateway

    monkeypatch.setattr(gateway, "setup_logging", lambda *args, **kwargs: None)
    moved = MINIMAL.replace(":8080/", ":8090/")  # the resident's probes bypass the gateway's 8080
    serving = moved.replace("[window]\n", '[window]\nserves = ["hyperqwen"]\n')
    assert [p.split(": ")[0] for p in gateway_problems(parse_config(moved))] == ["gateway", "window.serves"]
    assert [p.split(": ")[0] for p in gateway_problems(parse_config(serving))] == ["gateway"]
    assert [p.split(": ")[0] for p in gateway_problems(parse_config(moved + "[gateway]\n"))] == ["window.serves"]
    assert gateway_problems(parse_config(serving + "[gateway]\n")) == []
    path = tmp_path / "gpuswapd.toml"
    for text, code in ((moved, 78), (serving + "[gateway]\n", 0)):
        path.write_text(text)
        assert gateway.main(["--config", str(path), "--check-config"]) == code
    out = capsys.readouterr()
    assert out.err.count(f"gpuswapd-gateway: {path}: ") == 2 and out.out == f"{path}: ok\n", out
