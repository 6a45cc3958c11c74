"""The README's install and quickstart, command by command, on the test world.

Every command in the README's "Install" and "Quickstart" code blocks is either run here (``RUN``:
what this test does for it) or stands in ``SUBSTITUTED`` with what the test world has instead and
why: a command added to the README without either fails the first test below. What cannot run
here is the registry (``docker pull``), pacman (``pacman -U``), a real GPU, and the paths of a
real install (/etc, /usr/share/doc, /var/cache); the world gives the same units, daemon and
client their stand-ins: its systemd (a real one), its dockerd (a real one), its VRAM ledger.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import tomllib
import urllib.request
from typing import Any

from tests.conftest import TEST_BOOT_DELAY
from tests.integration.conftest import assert_resident_back, readable_package, wait_state
from tests.stack.config import ENGINE_ENV, stack_config
from tests.stack.daemon import BIN, RunningDaemon
from tests.stack.probe import RESIDENT_UNITS, Probe
from tests.stack.users import STRANGER, User
from tests.stack.world import ENGINE_IMAGE, ENGINE_PORT, PROXY_PORT, REPO, Stack

EXAMPLES = REPO / "units" / "examples"

# What the test does for each command it runs.
RUN = {
    "systemctl daemon-reload": "the world's systemd reloads (Reload over D-Bus)",
    "systemctl enable --now llama-swap.service": "llama-swap.service started; strata.service comes with it (Requires=)",
    "curl -s http://127.0.0.1:8080/v1/models": "GET /v1/models of llama-swap, on the world's 8090: 'strata'",
    "cp vllm-openai.toml /etc/gpuswapd/gpuswapd.toml": "the example, the world's substitutes over it",
    "gpuswapd --check-config": "gpuswapd --check-config --config on that file: ok",
    "systemctl enable --now gpuswapd.socket": "the shipped gpuswapd.socket and gpuswapd.service, started in the world",
    "usermod -aG gpuswap alice": f"usermod -aG gpuswap {STRANGER}, who could not plan before and can after",
    "gpuswapctl plan": "as that user: exit 0, strata.service and llama-swap.service would stop",
    "gpuswapctl acquire --for 15m": "as that user: exit 0, the engine's container runs, the resident is down",
    "curl -s http://127.0.0.1:18020/v1/models": "GET /v1/models of the engine: 'qwen2.5-7b'",
    "gpuswapctl status": "as that user: READY, the user's one lease",
    "gpuswapctl release": "as that user: exit 0, then IDLE with the resident, timers and card as before",
}
# What the test world has instead, and why.
SUBSTITUTED = {
    "cd packaging/arch": "tests/integration/test_package.py builds the package (packaging/arch/build.sh)",
    "makepkg": "run by tests/integration/test_package.py, through packaging/arch/build.sh",
    "sudo pacman -U gpuswapd-0.1.0-1-any.pkg.tar.zst": "no pacman on Debian: test_package.py checks what the package "
                                                       "installs where; here the units come from the checkout",
    "cd /usr/share/doc/gpuswapd/examples": "units/examples/ of the checkout (test_package.py: installed there)",
    "cp strata.service llama-swap.service /etc/systemd/system/": "the world's own strata and llama-swap units: "
        "the same Requires= link, with llama-server on a tiny model and llama-swap's stand-in (the examples pass "
        "systemd-analyze verify in tests/unit/test_examples.py)",
    "systemctl edit --full strata.service": "the world's strata.service runs its own tiny model, as 'strata'",
    "mkdir -p /etc/llama-swap": "llama-swap's stand-in takes its upstream on its command line",
    "cp llama-swap.yaml /etc/llama-swap/config.yaml": "llama-swap's stand-in takes its upstream on its command line",
    "docker pull vllm/vllm-openai:latest": "no registry: the world's engine simulator image, built locally",
}


def quickstart_commands() -> list[str]:
    """Return every command of the README's Install and Quickstart code blocks, comments stripped."""
    readme = (REPO / "README.md").read_text()
    commands = []
    for section in ("Install", "Quickstart"):
        [body] = re.findall(rf"^## {section}\b.*?\n(.*?)(?=^## )", readme, re.S | re.M)
        for block in re.findall(r"^```\n(.*?)^```", body, re.S | re.M):
            for line in block.splitlines():
                line = re.sub(r"\s{2,}#.*$", "", line).strip()
                commands += [part.strip() for part in line.split(" && ") if part.strip()]
    return commands


def test_every_quickstart_command_is_run_here_or_has_a_named_substitute() -> None:
    commands = quickstart_commands()
    assert "gpuswapctl acquire --for 15m" in commands and "makepkg" in commands
    assert sorted(c for c in commands if c not in RUN and c not in SUBSTITUTED) == []
    assert sorted(c for c in [*RUN, *SUBSTITUTED] if c not in commands) == []  # nothing stale here either


def _get_models(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def quickstart_config(world: Stack) -> Any:
    """Write units/examples/vllm-openai.toml with the world's substitutes over it; return the path."""
    example = tomllib.loads((EXAMPLES / "vllm-openai.toml").read_text())
    cache = world.paths.root / "quickstart-cache"
    container = example["window"]["container"]
    for host in container["volumes"]:
        (cache / os.path.basename(host)).mkdir(parents=True, exist_ok=True)
    sections: dict[str, dict[str, Any]] = {
        # Under socket activation daemon.socket is not used; the state lives in the world's directory.
        "daemon": {"socket_group": None},
        # The card is the world's VRAM ledger, read by its nvidia-smi.
        "gpu": example["gpu"],
        "resident": {k: v for k, v in example["resident"].items() if not isinstance(v, dict)},
        "resident__idle": {"kind": None, "url": None, "wait": None, "on_busy": None},  # the defaults, as the example
        # llama-swap is on 8090 in the world (8080 is the gateway's there).
        "resident__verify": {**example["resident"]["verify"], "prompt": None, "max_tokens": None, "timeout": None,
                             "url": f"http://127.0.0.1:{PROXY_PORT}/v1/chat/completions"},
        "timers": example["timers"],
        "window": {**{k: v for k, v in example["window"].items() if k not in ("container", "verify")},
                   "watch_interval": None, "max_restarts": None},
        "window__warmup": {"requests": None, "prompt": None, "max_tokens": None},
        "window__container": {
            "name": container["name"], "shm_size": container["shm_size"],
            # The engine simulator instead of vllm/vllm-openai: it serves the example's model name,
            # on the host's network (ports unused), with no GPU of Docker's (the ledger's instead).
            "image": ENGINE_IMAGE, "command": [], "ports": {}, "network_mode": "host", "gpus": [],
            "env": {**container["env"], **ENGINE_ENV, "ENGINE_MODEL": "qwen2.5-7b",
                    "ENGINE_BOOT_DELAY": TEST_BOOT_DELAY},
            # The example's two cache volumes, in the world's directory rather than the host's /var/cache.
            "volumes": {**{str(cache / os.path.basename(host)): inner for host, inner in container["volumes"].items()},
                        "/usr": "/usr:ro", str(world.paths.gpu): "/gpu"},
        },
        "window__verify": {**example["window"]["verify"], "prompt": None, "max_tokens": None, "timeout": None},
    }
    return stack_config(world, "quickstart", **sections)


def ctl_as_login(world: Stack, daemon: RunningDaemon, user: User, *args: str) -> tuple[int, str, str]:
    """Run gpuswapctl as ``user`` with the groups a login would give it now (/etc/group), from a copy it can read."""
    out = subprocess.run(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups",
                          "/usr/bin/python3", "-m", "gpuswapd.ctl.main", "--socket", str(daemon.socket), *args],
                         env={"PYTHONPATH": str(readable_package(world)), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout, out.stderr


def _stop(world: Stack, probe: Probe, unit: str) -> None:
    world.manager("StopUnit", "ss", unit, "replace", check=False)
    wait_state(probe, unit, {"inactive", "failed"}, timeout=90)


def test_the_quickstart_reaches_a_first_window(world: Stack, probe: Probe, users: dict[str, User]) -> None:
    # 1. The resident.
    world.manager("Reload")
    world.manager("StartUnit", "ss", "llama-swap.service", "replace")
    assert wait_state(probe, "llama-swap.service", {"active"}) == "active"
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "active")
    assert "strata" in _get_models(PROXY_PORT)

    # 2. The engine's image is there (no pull).
    assert world.docker("image", "inspect", ENGINE_IMAGE).returncode == 0

    # 3. The configuration.
    config = quickstart_config(world)
    checked = subprocess.run([str(BIN / "gpuswapd"), "--check-config", "--config", str(config)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, **world.env()})
    assert checked.returncode == 0 and checked.stdout.strip().endswith(": ok"), checked.stdout + checked.stderr

    # 4. The daemon: the shipped units, with a drop-in that points them at this checkout and the world.
    subprocess.run(["systemd-sysusers", str(REPO / "units" / "sysusers.d" / "gpuswapd.conf")], check=True,
                   capture_output=True, timeout=60)
    env = world.env()
    world.install_unit("gpuswapd.socket", (REPO / "units" / "gpuswapd.socket").read_text(),
                       {"test-world.conf": "[Unit]\nDefaultDependencies=no\n"})
    world.install_unit("gpuswapd.service", (REPO / "units" / "gpuswapd.service").read_text(), {
        "test-world.conf": (
            "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\n"
            f"ExecStart={BIN}/gpuswapd --config {config}\n"
            f"Environment=DOCKER_HOST={env['DOCKER_HOST']} PATH={env['PATH']}\n"
            + (f"Environment=PYTHONPATH={os.environ['PYTHONPATH']}\n" if os.environ.get("PYTHONPATH") else "")
            + f"BindPaths={world.paths.root}\nBindReadOnlyPaths={REPO}\n")})
    try:
        world.manager("StartUnit", "ss", "gpuswapd.socket", "replace")
        assert wait_state(probe, "gpuswapd.socket", {"active"}) == "active"
        daemon = RunningDaemon(world, config, world.paths.run / "gpuswapd" / "gpuswapd.sock")
        who = users[STRANGER]
        code, _, err = ctl_as_login(world, daemon, who, "plan")
        assert code == 4 and "gpuswap" in err, (code, err)  # not yet a member
        subprocess.run(["usermod", "-aG", "gpuswap", who.name], check=True, capture_output=True, timeout=30)
        try:
            _first_window(world, probe, daemon, who)
        finally:
            subprocess.run(["gpasswd", "-d", who.name, "gpuswap"], check=False, capture_output=True, timeout=30)
    finally:
        _stop(world, probe, "gpuswapd.service")
        _stop(world, probe, "gpuswapd.socket")


def _first_window(world: Stack, probe: Probe, daemon: RunningDaemon, member: User) -> None:
    # 5. The first window, as the member (after her next login).
    code, out, err = ctl_as_login(world, daemon, member, "plan")
    assert code == 0, err
    assert "strata.service" in out and "llama-swap.service" in out, out
    code, out, err = ctl_as_login(world, daemon, member, "acquire", "--for", "15m")
    assert code == 0, out + err
    assert [(c["Names"], c["State"]) for c in probe.containers()] == [("vllm", "running")]
    assert probe.states(list(RESIDENT_UNITS)) == dict.fromkeys(RESIDENT_UNITS, "inactive")
    assert _get_models(ENGINE_PORT) == ["qwen2.5-7b"]
    code, out, err = ctl_as_login(world, daemon, member, "status", "--json")
    assert code == 0, err
    status = json.loads(out)
    assert status["phase"] == "READY", status
    [lease] = status["window"]["leases"]
    assert lease["holder"].startswith(member.name), lease  # USER[PID]: bound to her uid
    code, out, err = ctl_as_login(world, daemon, member, "release")
    assert code == 0, out + err
    deadline = time.monotonic() + 90
    while json.loads(daemon.ctl("status", "--json").stdout)["phase"] != "IDLE":
        assert time.monotonic() < deadline, "the window did not close within 90 s"
        time.sleep(0.2)
    assert_resident_back(probe)
