"""The unit files of the test world's systemd: the resident, the proxy, agents, one other timer.

Every unit has ``DefaultDependencies=no``: this systemd never reaches sysinit.target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.stack import llama


@dataclass(frozen=True)
class Spec:
    """What the unit files point at."""

    root: Path
    python: str
    sim: Path
    gpu: Path
    control: Path
    logs: Path
    slots: Path
    llama_server: Path
    model: Path
    agents: tuple[str, ...]
    other_timer: str
    resident_vram: str
    resident_port: int
    proxy_port: int


def _unit(description: str, unit: str = "", service: str = "", install: str = "") -> str:
    text = f"[Unit]\nDescription={description}\nDefaultDependencies=no\n{unit}"
    if service:
        text += f"\n[Service]\n{service}"
    if install:
        text += f"\n{install}"
    return text


def _logs(spec: Spec, name: str) -> str:
    return f"StandardOutput=append:{spec.logs}/{name}.log\nStandardError=inherit\n"


def resident_on_card(spec: Spec, name: str, port: int, card: int) -> str:
    """Return the unit of a resident llama-server on GPU ``card`` (no proxy, no timers): a second card's."""
    args = " ".join(llama.llama_server_args(spec.model, port, ctx=4096, parallel=2, alias=name))
    return _unit(
        f"{name}: the resident model on GPU {card} (llama.cpp llama-server)",
        "",
        f"Type=exec\nExecStart={spec.python} {spec.sim}/gpu_hold.py --dir {spec.gpu} --card {card} --name {name} "
        f"--bytes {spec.resident_vram} -- {spec.llama_server} {args}\nTimeoutStopSec=20\n{_logs(spec, name)}",
    )


RESIDENT_CTX = 4096  # per slot
RESIDENT_SLOTS = 2


def resident_exec(spec: Spec, alias: str = "strata") -> str:
    """Return strata's ExecStart=: llama-server on the simulated card, fitting itself if a test asked (llama.Fit)."""
    server_args = " ".join(llama.llama_server_args(spec.model, spec.resident_port, ctx=RESIDENT_CTX,
                                                   parallel=RESIDENT_SLOTS, alias=alias))
    # --slot-save-path: the agents' slots are saved before a window and restored after it (gpuswapd's resident.cache).
    return (f"ExecStart={spec.python} {spec.sim}/llama_fit.py --dir {spec.gpu} --name strata "
            f"--bytes {spec.resident_vram} --fit-file {spec.control}/{llama.FIT_FILE} -- {spec.llama_server} "
            f"{server_args} --slot-save-path {spec.slots}\n")


def render(spec: Spec) -> dict[str, str]:
    """Return every unit file of the test world, by name."""
    py, sim = spec.python, spec.sim
    files: dict[str, str] = {
        "dbus.socket": _unit("D-Bus System Message Bus Socket", "", "")
        + "\n[Socket]\nListenStream=/run/dbus/system_bus_socket\n",
        "dbus.service": _unit(
            "D-Bus System Message Bus",
            "Requires=dbus.socket\nAfter=dbus.socket\n",
            "Type=notify\nNotifyAccess=main\nExecStart=/usr/bin/dbus-daemon --system --address=systemd: "
            "--nofork --nopidfile --systemd-activation --syslog-only\n",
        ),
        "strata.service": _unit(
            "strata: the resident model (llama.cpp llama-server)",
            "",
            f"Type=exec\n{resident_exec(spec)}TimeoutStopSec=20\n{_logs(spec, 'strata')}",
        ),
        "llama-swap.service": _unit(
            "llama-swap proxy in front of strata",
            "Requires=strata.service\nAfter=strata.service\n",
            f"Type=exec\nExecStart={py} {sim}/llama_swap.py --listen 127.0.0.1:{spec.proxy_port} "
            f"--upstream http://127.0.0.1:{spec.resident_port} --model strata --control {spec.control}\n"
            f"TimeoutStopSec=10\n{_logs(spec, 'llama-swap')}",
        ),
    }
    timers = [f"agent-{a}.timer" for a in spec.agents] + [spec.other_timer]
    for timer in timers:
        name = timer.removesuffix(".timer")
        if name.startswith("agent-"):
            run = (
                f"{py} {sim}/agent_job.py --url http://127.0.0.1:{spec.proxy_port}/v1/chat/completions "
                f"--model strata --name {name} --hold-file {spec.control}/{name}.hold"
            )
        else:
            run = "/bin/true"
        files[f"{name}.service"] = _unit(f"{name} job", "", f"Type=oneshot\nExecStart={run}\n{_logs(spec, name)}")
        # Far in the future: tests start the jobs themselves; the timers only need to be armed.
        files[timer] = _unit(f"{name} timer", "", "") + "\n[Timer]\nOnActiveSec=1h\nOnUnitActiveSec=1h\n"
    wants = " ".join(["dbus.socket", "dbus.service", "strata.service", "llama-swap.service", *timers])
    files["stack.target"] = _unit("the gpuswapd test world", f"Wants={wants}\n")
    files["stack-halt.target"] = _unit(
        "the test world, stopping", "Requires=dbus.socket dbus.service\nAllowIsolate=yes\n"
    )
    return files
