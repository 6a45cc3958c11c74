"""What ``--check-config`` checks against this machine rather than the file: env files and the card.

Each engine profile's ``container.env_file`` must exist, be readable and parse (a start would
find it only at the first acquire, with the resident already asked to drain). Each size the
window waits for (``gpu.resident_needs``, ``gpu.window_needs``, a profile's ``needs``) must fit
on the card: one that cannot is an error when the card can be read, and a warning says so when
it cannot (no probe, no driver, another machine).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from gpuswapd import workers
from gpuswapd.adapters.docker import read_env_file
from gpuswapd.adapters.gpu import GpuProbe, make_probe
from gpuswapd.checks.bootchecks import where
from gpuswapd.config import DEFAULT_PROFILE, Config, GpuConfig
from gpuswapd.errors import DockerError, GpuProbeError
from gpuswapd.sizes import format_size

# The defaults of gpu.resident_needs and gpu.window_needs are a 24 GB card's (an RTX 3090's).
DEFAULT_GPU = GpuConfig()


@dataclass
class MachineCheck:
    """What the configuration comes to on this machine: errors (exit 78) and warnings."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_machine(config: Config, probe: GpuProbe | None = None) -> MachineCheck:
    """Check the env files and the sizes against the card (``probe``: a test's; else ``gpu.probe``'s)."""
    found = MachineCheck(errors=env_file_errors(config))
    total, why = card_memory(config.gpu, probe if probe is not None else make_probe(config.gpu))
    if total is None:
        found.warnings.append(unchecked_sizes(config, why))
    else:
        found.errors.extend(size_errors(config, total))
    return found


def env_file_errors(config: Config) -> list[str]:
    """List each engine profile's env file that is missing, unreadable or does not parse."""
    out = []
    for p in config.engine_profiles():
        path = p.engine.container.env_file
        if not path:
            continue
        key = f"{where(p)}.container.env_file"
        try:
            read_env_file(path)
        except DockerError as err:
            out.append(f"{key}: {err.message}; fix the file or the key (Docker reads it as --env-file does)")
    return out


def card_memory(gpu: GpuConfig, probe: GpuProbe | None) -> tuple[int | None, str]:
    """Return the card's total memory in bytes, or None and why it cannot be read (within gpu.probe_timeout)."""
    if probe is None:
        return None, "gpu.probe = \"none\""
    answers: queue.Queue[tuple[int | None, str]] = queue.Queue(maxsize=1)

    def done(reading: object, error: BaseException | None) -> None:
        if isinstance(error, GpuProbeError):
            answers.put((None, error.message))
        elif error is not None:
            answers.put((None, f"{type(error).__name__}: {error}"))
        else:
            answers.put((getattr(reading, "total_bytes", None), "the probe gave no total"))

    # A daemon thread: a driver call that hangs never keeps --check-config from exiting.
    workers.own_thread("check-card").submit(lambda: probe.read(processes=False), done)
    try:
        return answers.get(timeout=gpu.probe_timeout + 0.5)  # nvidia-smi's own deadline says more: let it come first
    except queue.Empty:
        return None, f"the GPU probe ({gpu.probe}) did not answer within {gpu.probe_timeout:g}s"


def size_errors(config: Config, total: int) -> list[str]:
    """List each size the window waits for that a card of ``total`` bytes cannot hold."""
    card = f"the card's {format_size(total)} (GPU {config.gpu.index})"
    sizes = [("gpu.resident_needs", config.gpu.resident_needs), ("gpu.window_needs", config.gpu.window_needs)]
    sizes += [(f"profiles.{p.name}.needs", p.needs) for p in config.all_profiles()
              if p.name != DEFAULT_PROFILE and p.needs != config.gpu.window_needs]
    return [f"{key}: {format_size(size)} is more than {card}: no window could ever wait it out; set it to what "
            "the model needs (at most the card's memory)" for key, size in sizes if size > total]


def unchecked_sizes(config: Config, why: str) -> str:
    """Say that the sizes were not checked against the card, and what they assume if left at their defaults."""
    gpu = config.gpu
    text = (f"gpu: the card's memory cannot be read ({why}): gpu.resident_needs ({format_size(gpu.resident_needs)}) "
            f"and gpu.window_needs ({format_size(gpu.window_needs)}) are not checked against it")
    if (gpu.resident_needs, gpu.window_needs) == (DEFAULT_GPU.resident_needs, DEFAULT_GPU.window_needs):
        text += "; both are the defaults, which assume a 24 GB card: set them for yours"
    return text

