"""A gpuswapd configuration that points at the test world (shared by tests, demo and benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.stack.world import ENGINE_IMAGE, ENGINE_PORT, ENGINE_VRAM, PROXY_PORT, RESIDENT_PORT, Stack

ENGINE_ENV = {
    "PORT": str(ENGINE_PORT),
    "GPUSIM_DIR": "/gpu",
    "ENGINE_VRAM": ENGINE_VRAM,
    "ENGINE_MODEL": "hyperqwen",
    "ENGINE_BOOT_DELAY": "1.0",
    "ENGINE_TOKENS_PER_CHUNK": "3",
    "ENGINE_CHUNK_DELAY": "0.005",
}


EVAL_PORT = ENGINE_PORT + 1  # a second engine profile's server


def profile_sections(stack: Stack, bare_needs: str = "20GiB") -> dict[str, dict[str, Any]]:
    """Sections for ``stack_config`` that add two profiles: "eval" (a second engine) and "bare"."""
    p = stack.paths
    return {
        "profiles__eval": {"kind": "engine", "health_url": f"http://127.0.0.1:{EVAL_PORT}/health",
                           "boot_timeout": "60s", "watch_interval": "1s", "max_restarts": 2},
        "profiles__eval__container": {
            "name": "qwen-eval", "image": ENGINE_IMAGE, "create": True, "env_file": "",
            "env": {**ENGINE_ENV, "PORT": str(EVAL_PORT), "ENGINE_NAME": "qwen-eval", "ENGINE_MODEL": "qwen-eval"},
            "ports": {}, "network_mode": "host", "gpus": [], "volumes": {"/usr": "/usr:ro", str(p.gpu): "/gpu"},
            "shm_size": "", "command": [], "stop_timeout": "10s"},
        "profiles__eval__warmup": {"requests": 1, "max_tokens": 16},
        "profiles__eval__verify": {"url": f"http://127.0.0.1:{EVAL_PORT}/v1/chat/completions", "model": "qwen-eval",
                                   "max_tokens": 16, "timeout": "30s"},
        "profiles__bare": {"kind": "bare", "needs": bare_needs},
    }


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def stack_config(stack: Stack, name: str = "gpuswapd", **sections: dict[str, Any]) -> Path:
    """Write a config for this stack; ``sections`` override keys, e.g. ``daemon={"linger": "2s"}`` (None: leave out)."""
    p = stack.paths
    home = p.root / "gpuswapd" / name
    home.mkdir(parents=True, exist_ok=True)
    tables: dict[str, dict[str, Any]] = {
        "daemon": {"socket": str(home / "gpuswapd.sock"), "socket_group": "", "state_dir": str(home / "state"),
                   "default_lease": "15m", "max_lease": "4h", "linger": "0.3s", "on_shutdown": "restore"},
        "gpu": {"probe": "nvidia-smi", "nvidia_smi": str(p.bin / "nvidia-smi"), "index": 0,
                "window_needs": "21GiB", "resident_needs": "22GiB", "release_timeout": "20s"},
        "resident": {"units": ["strata.service"], "stop_timeout": "30s", "start_timeout": "60s",
                     "server": "llama.cpp", "props_url": f"http://127.0.0.1:{RESIDENT_PORT}/props"},
        "resident.idle": {"kind": "llama.cpp-slots", "url": f"http://127.0.0.1:{RESIDENT_PORT}/slots",
                          "wait": "5s", "on_busy": "fail"},
        "resident.verify": {"url": f"http://127.0.0.1:{PROXY_PORT}/v1/chat/completions", "model": "strata",
                            "prompt": "Reply with the single word: ready", "max_tokens": 16, "timeout": "60s"},
        "timers": {"pause": ["agent-*.timer"], "wait_for_jobs": "60s"},
        "window": {"health_url": f"http://127.0.0.1:{ENGINE_PORT}/health", "boot_timeout": "60s",
                   "watch_interval": "1s", "max_restarts": 2},
        "window.container": {"name": "hyperqwen", "image": ENGINE_IMAGE, "create": True, "env_file": "",
                             "env": dict(ENGINE_ENV), "ports": {}, "network_mode": "host", "gpus": [],
                             "volumes": {"/usr": "/usr:ro", str(p.gpu): "/gpu"}, "shm_size": "",
                             "command": [], "stop_timeout": "10s"},
        "window.warmup": {"requests": 2, "prompt": "Write a haiku about GPUs.", "max_tokens": 64},
        "window.verify": {"url": f"http://127.0.0.1:{ENGINE_PORT}/v1/chat/completions", "model": "hyperqwen",
                          "prompt": "Reply with the single word: ready", "max_tokens": 64, "timeout": "30s"},
    }
    for section, overrides in sections.items():
        tables.setdefault(section.replace("__", "."), {}).update(overrides)
    text = "".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items() if v is not None) + "\n"
                   for name, keys in tables.items())
    path = home / "gpuswapd.toml"
    path.write_text(text)
    return path
