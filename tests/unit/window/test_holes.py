"""The small holes: Infinity on the wire, a planted link, a secret in an env file, numbers of 400 digits."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from gpuswapd.adapters.docker import read_env_file
from gpuswapd.config import parse_config
from gpuswapd.errors import ConfigError, DockerError, RequestError
from gpuswapd.events import EventBus
from gpuswapd.logs import setup_logging
from gpuswapd.observe import textfile
from gpuswapd.observe.hooks import Hooks
from gpuswapd.protocol import encode, parse_request
from gpuswapd.server.listen import own_socket
from gpuswapd.server.watch import Watchers
from gpuswapd.sizes import SizeError, parse_size
from gpuswapd.state.store import StateStore
from tests.fakes import CONFIG, FakeWorld, running, settle
from tests.unit.conftest import ask, connect, serve

SECRET = "hf_s3cr3tT0k3nValue"
HUGE = "9" * 400


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def strict(line: bytes | str) -> Any:
    """Parse JSON as jq does: Infinity and NaN are not JSON."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


@pytest.fixture
def bus() -> Iterator[EventBus]:
    bus = EventBus()
    before = structlog.get_config()
    setup_logging("warning", json=True, cache=False, tap=bus.tap)
    try:
        yield bus
    finally:
        structlog.configure(**before)


# -- a lease for infinity is null, not Infinity ---------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="only root may hold a lease for infinity")
def test_a_lease_for_infinity_is_null_in_the_watch_stream_and_on_a_hooks_stdin(
        bus: EventBus, tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)
    server.watchers = Watchers(bus)
    out = tmp_path / "hook"
    out.mkdir()
    hook = tmp_path / "hook.py"
    hook.write_text("import sys, os\nd = sys.stdin.read()\nopen(os.path.join(sys.argv[1], 'event.json'), 'w')"
                    ".write(d)\n")
    hooks = Hooks([sys.executable, str(hook), str(out)], ["lease_granted"], 10)
    bus.subscribe(hooks.on_event)

    async def main() -> None:
        bus.attach(asyncio.get_running_loop())
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            reader, writer = await asyncio.open_unix_connection(sock=await asyncio.to_thread(connect, path))
            writer.write(b'{"op": "watch"}\n')
            assert strict(await reader.readline()) == {"event": "subscribed"}
            reply = await ask(path, {"op": "acquire", "for": "infinity", "holder": "slurm-job-7"})
            assert reply["ok"], reply
            while True:
                event = strict(await asyncio.wait_for(reader.readline(), 10))
                if event["event"] == "lease_granted":
                    break
            assert event["duration_s"] is None and event["holder"] == "slurm-job-7"
            for _ in range(500):
                if (out / "event.json").exists() and (out / "event.json").read_text():
                    break
                await asyncio.sleep(0.01)
            hooked = strict((out / "event.json").read_text())
            assert hooked["event"] == "lease_granted" and hooked["duration_s"] is None
            writer.close()
            await w.release(reply["lease"]["id"])
            await settle(w)
            await hooks.close()
            await server.close()
        bus.detach()

    run(main())


def test_encode_writes_null_for_what_is_not_finite() -> None:
    assert strict(encode({"a": float("inf"), "b": [float("-inf"), float("nan"), 1.5], "c": {"d": float("inf")}})) == \
        {"a": None, "b": [None, None, 1.5], "c": {"d": None}}


# -- the metrics textfile: no write through a planted link ----------------------------------------


def test_a_link_planted_at_the_temporary_name_does_not_redirect_the_write(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(tmp_path)
    store.write(b'{"the": "state"}\n')
    before = store.current.read_bytes()
    target = tmp_path / "gpuswapd.prom"
    planted = [tmp_path / ".gpuswapd.prom.planted-1.tmp", tmp_path / ".gpuswapd.prom.planted-2.tmp"]
    for link in planted:
        link.symlink_to(store.current)  # a local user who guessed the name links it to state.json
    names = iter([*planted, tmp_path / ".gpuswapd.prom.free.tmp"])
    monkeypatch.setattr(textfile, "temporary_name", lambda path: next(names))
    textfile.write_atomically(target, b"gpuswapd_leases 0\n")
    assert store.current.read_bytes() == before  # the state is untouched
    assert target.read_bytes() == b"gpuswapd_leases 0\n" and not target.is_symlink()
    # Every name taken: the write fails, and still writes nothing through a link.
    monkeypatch.setattr(textfile, "temporary_name", lambda path: planted[0])
    with pytest.raises(FileExistsError):
        textfile.write_atomically(target, b"gpuswapd_leases 1\n")
    assert store.current.read_bytes() == before


def test_the_temporary_name_cannot_be_guessed_from_the_pid_and_a_counter() -> None:
    a, b = textfile.temporary_name(Path("/x/gpuswapd.prom")), textfile.temporary_name(Path("/x/gpuswapd.prom"))
    assert a.name.split("-")[-1] != b.name.split("-")[-1]
    assert len(a.name.split("-")[-1].removesuffix(".tmp")) == 16


# -- an env file's errors never show its values ---------------------------------------------------


@pytest.mark.parametrize("line", [f"HF_TOKEN: {SECRET}", f"HF_TOKEN {SECRET}=x", f"HF_TOKEN:{SECRET}",
                                  f"{SECRET} x", f" =={SECRET}"])
def test_an_env_file_error_names_the_line_and_the_key_never_the_value(tmp_path: Path, line: str) -> None:
    env = tmp_path / "vllm.env"
    env.write_text(f"A=1\n{line}\n")
    with pytest.raises(DockerError) as err:
        read_env_file(str(env))
    assert SECRET not in err.value.message and SECRET[3:12] not in err.value.message
    assert "line 2" in err.value.message
    if line.startswith("HF_TOKEN"):
        assert "'HF_TOKEN'" in err.value.message


def test_an_env_file_that_is_not_utf8_does_not_quote_its_bytes(tmp_path: Path) -> None:
    env = tmp_path / "vllm.env"
    env.write_bytes(b"HF_TOKEN=hf_\xff\xfe" + SECRET.encode() + b"\n")
    with pytest.raises(DockerError, match="not UTF-8 \\(at byte 12\\)") as err:
        read_env_file(str(env))
    assert "xff" not in err.value.message and SECRET not in err.value.message


def test_a_window_failing_on_its_env_file_shows_no_secret_in_status(tmp_path: Path) -> None:
    env = tmp_path / "vllm.env"
    env.write_text(f"HF_TOKEN: {SECRET}\n")
    config = parse_config(CONFIG.replace('env_file = "/dev/null"', f'env_file = "{env}"'), "<secret>")
    world = FakeWorld(config=config)
    server, path = serve(world, tmp_path)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            reply = await ask(path, {"op": "acquire", "for": 60, "holder": "job"})
            assert not reply["ok"] and "line 1" in reply["error"]["message"], reply
            await settle(w)
            status = await ask(path, {"op": "status"})
            history = await ask(path, {"op": "history"})
            await server.close()
        text = json.dumps([reply, status, history])
        assert "HF_TOKEN" in text and SECRET not in text

    run(main())


# -- numbers of hundreds of digits are refused, not crashes ---------------------------------------


def test_a_size_of_400_digits_is_a_size_error() -> None:
    with pytest.raises(SizeError, match="out of range"):
        parse_size(HUGE)
    with pytest.raises(SizeError, match="out of range"):
        parse_size(f"{HUGE}GiB")
    assert parse_size("1.5GiB") == 1536 * 1024**2 and parse_size("20GB") == 20 * 10**9


@pytest.mark.parametrize(("key", "value"), [
    ("gpu.window_needs", f'"{HUGE}"'), ("gpu.window_needs", f'"{HUGE}.5k"'), ("daemon.linger", HUGE),
    ("daemon.linger", f'"{HUGE}s"'), ("daemon.linger", "1e400"), ("daemon.priority_max_nonroot", HUGE),
    ("daemon.max_clients", "9" * 5000), ("metrics.listen", f'"127.0.0.1:{"9" * 5000}"'),
])
def test_a_huge_number_in_the_config_names_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(with_key(key, value), "<huge>")
    assert name_of(key) in err.value.message or "will not read" in err.value.message, err.value.message
    assert len(err.value.message) < 400


def name_of(key: str) -> str:
    return key.split(".")[1]


def with_key(key: str, value: str) -> str:
    """Set ``table.name = value`` in the fakes' configuration (replacing the line if it has one)."""
    table, name = key.split(".")
    lines = CONFIG.splitlines()
    start = lines.index(f"[{table}]") if f"[{table}]" in lines else None
    if start is None:
        return CONFIG + f"\n[{table}]\n{name} = {value}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    body = [ln for ln in lines[start + 1:end] if not ln.startswith(f"{name} ")]
    return "\n".join([*lines[:start + 1], f"{name} = {value}", *body, *lines[end:]]) + "\n"


def test_the_daemon_exits_78_on_a_size_of_400_digits(tmp_path: Path) -> None:
    pytest.importorskip("pydbus")  # the daemon's module needs it (the package's check() runs without)
    config = tmp_path / "gpuswapd.toml"
    config.write_text(with_key("gpu.window_needs", f'"{HUGE}"'))
    # In a process of its own: the daemon's main() configures the log of the whole process.
    out = subprocess.run([sys.executable, "-c", "import sys; from gpuswapd.daemon import main; sys.exit(main())",
                          "--config", str(config), "--check-config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 78, out.stderr  # EX_CONFIG
    assert "gpu.window_needs" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("request_line", [
    f'{{"op": "acquire", "for": {HUGE}}}', f'{{"op": "acquire", "timeout": {HUGE}}}',
    f'{{"op": "acquire", "priority": {HUGE}}}', f'{{"op": "acquire", "priority": -{HUGE}}}',
    f'{{"op": "renew", "for": "{HUGE}s"}}', f'{{"op": "history", "limit": {HUGE}}}',
    '{"op": "acquire", "for": ' + "9" * 5000 + "}",
])
def test_a_request_with_a_huge_number_is_a_clear_refusal(request_line: str) -> None:
    with pytest.raises(RequestError):
        parse_request(request_line.encode())


def test_the_server_answers_a_huge_span_with_an_error_and_changes_nothing(tmp_path: Path) -> None:
    world = FakeWorld()
    server, path = serve(world, tmp_path)

    async def main() -> None:
        async with running(server.window) as w:
            await server.start(own_socket(str(path), "", 0o600))
            reply = await ask(path, {"op": "acquire", "for": int(HUGE), "holder": "x"})
            assert reply["error"]["code"] == "bad_request" and "'for'" in reply["error"]["message"], reply
            assert w.phase.name == "IDLE"
            await server.close()

    run(main())


def test_config_and_server_config_still_parse(tmp_path: Path) -> None:
    config = parse_config(CONFIG, "<fake>")
    assert dataclasses.replace(config.daemon).priority_min_nonroot == -10
    assert "cron.service" in config.daemon.never_stop and "systemd-*" in config.daemon.never_stop
    with pytest.raises(ConfigError, match="priority_min_nonroot"):
        parse_config(CONFIG.replace("[daemon]\n", "[daemon]\npriority_min_nonroot = 5\n", 1), "<x>")
