"""The [metrics] and [hooks] sections: every problem refused at start (exit 78) with the key named."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpuswapd.config import parse_config
from gpuswapd.errors import ConfigError
from gpuswapd.events import KNOWN_EVENTS
from tests.unit.conftest import MINIMAL


def _config(text: str) -> None:
    parse_config(MINIMAL + text)


def test_both_are_off_by_default() -> None:
    config = parse_config(MINIMAL)
    assert config.metrics.listen == "" and config.metrics.textfile == ""
    assert config.hooks.command == [] and set(config.hooks.events) <= KNOWN_EVENTS
    assert config.hooks.timeout == 10.0


@pytest.mark.parametrize("listen, problem", [
    ("9477", "expected host:port"),
    (":9477", "expected host:port"),
    ("127.0.0.1:http", "expected host:port"),
    ("127.0.0.1:0", "0 would pick a random port"),
    ("127.0.0.1:70000", "out of range"),
])
def test_listen_must_be_host_and_port(listen: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=f"metrics.listen: .*{problem}"):
        _config(f'[metrics]\nlisten = "{listen}"\n')


def test_listen_takes_ipv4_ipv6_and_names() -> None:
    for listen in ("127.0.0.1:9477", "[::1]:9477", "localhost:9477", "0.0.0.0:9477"):
        assert parse_config(MINIMAL + f'[metrics]\nlisten = "{listen}"\n').metrics.listen == listen


def test_textfile_directory_must_exist_and_be_writable(tmp_path: Path) -> None:
    ok = tmp_path / "gpuswapd.prom"
    assert parse_config(MINIMAL + f'[metrics]\ntextfile = "{ok}"\n').metrics.textfile == str(ok)
    with pytest.raises(ConfigError, match=r"metrics\.textfile: no directory"):
        _config(f'[metrics]\ntextfile = "{tmp_path}/missing/gpuswapd.prom"\n')
    with pytest.raises(ConfigError, match=r"metrics\.textfile: must be an absolute path"):
        _config('[metrics]\ntextfile = "gpuswapd.prom"\n')
    with pytest.raises(ConfigError, match=r"metrics\.textfile: node_exporter reads only files ending in \.prom"):
        _config(f'[metrics]\ntextfile = "{tmp_path}/gpuswapd.txt"\n')
    if os.geteuid() != 0:  # root writes anywhere here (in the unit, without CAP_DAC_OVERRIDE, it does not)
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(ConfigError, match=r"is not writable by gpuswapd"):
            _config(f'[metrics]\ntextfile = "{locked}/gpuswapd.prom"\n')


def test_hook_command_must_be_an_absolute_executable(tmp_path: Path) -> None:
    assert parse_config(MINIMAL + f'[hooks]\ncommand = ["{sys.executable}", "-c", "pass"]\n').hooks.command[0] \
        == sys.executable
    with pytest.raises(ConfigError, match=r"hooks.command\[0\]: must be an absolute path"):
        _config('[hooks]\ncommand = ["notify-send"]\n')
    script = tmp_path / "hook"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(ConfigError, match=r"hooks.command\[0\]: .* is not an executable file"):
        _config(f'[hooks]\ncommand = ["{script}"]\n')
    with pytest.raises(ConfigError, match=r"hooks.command\[0\]: .* is not an executable file"):
        _config(f'[hooks]\ncommand = ["{tmp_path}"]\n')


def test_hook_events_must_be_known() -> None:
    with pytest.raises(ConfigError, match=r"hooks.events\[1\]: no event 'window_exploded'"):
        _config('[hooks]\nevents = ["window_failed", "window_exploded"]\n')
    with pytest.raises(ConfigError, match=r"hooks\.timeout"):
        _config('[hooks]\ntimeout = "0"\n')
