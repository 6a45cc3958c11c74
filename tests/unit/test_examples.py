"""Every example configuration in units/examples passes --check-config on a 24 GB card, warning of nothing."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.conftest import card_of

EXAMPLES = Path(__file__).resolve().parents[2] / "units" / "examples"
CONFIGS = sorted(EXAMPLES.rglob("*.toml"))


def test_there_are_examples_of_each_layout() -> None:
    assert {p.relative_to(EXAMPLES).as_posix() for p in CONFIGS} >= {"vllm-openai.toml", "llama-swap-cmd/gpuswapd.toml"}


@pytest.mark.parametrize("example", CONFIGS, ids=[p.relative_to(EXAMPLES).as_posix() for p in CONFIGS])
def test_the_example_passes_check_config_without_a_warning(example: Path, tmp_path: Path, daemon: ModuleType,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    text = example.read_text()
    gpu = card_of(tmp_path)  # read through nvidia-smi: the example's [gpu] keeps its sizes
    text = text.replace("[gpu]\n", f"[gpu]\n{gpu}", 1) if "[gpu]\n" in text else f"{text}\n[gpu]\n{gpu}"
    config = tmp_path / "gpuswapd.toml"
    config.write_text(text)
    assert daemon.main(["--config", str(config), "--check-config"]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert out.out == f"{config}: ok\n" and out.err == "", out.err
