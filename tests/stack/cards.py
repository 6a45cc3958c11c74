"""A second simulated GPU in the test world, for the tests of one gpuswapd per GPU.

The world boots with one card: GPU 0, with strata behind llama-swap and the agent timers, as
every other test expects. ``add_second_card`` gives the ledger a second card and starts
``strata1.service``, a second resident (its own llama-server on its own port, no proxy, no
timers) that holds GPU 1. The world's ``reset`` takes both away again: strata1 is an extra unit,
and the ledger goes back to one card.

Each card gets its own gpuswapd instance: ``instance_sections`` are the ``stack_config``
overrides of instance "0" (GPU 0, the world's usual resident and engine) or "1" (GPU 1, strata1
and an engine "hyperqwen1" on its own port), both on the world's one dockerd.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.stack import units
from tests.stack.config import ENGINE_ENV
from tests.stack.world import ENGINE_PORT, Stack, StackError, _listening, _wait, http_status

RESIDENT1 = "strata1.service"
RESIDENT1_PORT = 8082
ENGINE1_PORT = 18030


def add_second_card(stack: Stack) -> float:
    """Give the world GPU 1 and a resident on it (strata1.service); return how long that took."""
    started = time.monotonic()
    if _listening(RESIDENT1_PORT):
        raise StackError(f"port {RESIDENT1_PORT} is taken by a process outside the test world: "
                         f"`ss -ltnp 'sport = :{RESIDENT1_PORT}'` shows which")
    stack._ledger("cards", "2")
    stack.install_unit(RESIDENT1, units.resident_on_card(stack._spec(), "strata1", RESIDENT1_PORT, 1))
    stack.manager("StartUnit", "ss", RESIDENT1, "replace")
    _wait("strata1 /health 200", lambda: http_status(f"http://127.0.0.1:{RESIDENT1_PORT}/health") == 200, 60)
    return time.monotonic() - started


def instance_sections(stack: Stack, name: str, run_dir: Path | None, state_root: Path | None) -> dict[str, Any]:
    """Return the ``stack_config`` overrides of instance ``name`` ("0" or "1"), on GPU ``int(name)``.

    ``daemon.socket`` and ``daemon.state_dir`` are the instance's own under ``run_dir`` and
    ``state_root`` (what $GPUSWAPD_RUNTIME_DIR and $GPUSWAPD_STATE_ROOT say), or left out when None.
    """
    card = int(name)
    own = {"socket": str(run_dir / f"{name}.sock") if run_dir else None,
           "state_dir": str(state_root / name) if state_root else None}
    # Short simulated delays: these tests open and close several windows.
    sections: dict[str, Any] = {
        "daemon": {**own, "linger": "0.5s"},
        "gpu": {"index": card},
        "window.warmup": {"requests": 1, "max_tokens": 16},
    }
    if card == 0:
        sections["window.container"] = {"env": {**ENGINE_ENV, "ENGINE_BOOT_DELAY": "0.5"}}
        return sections
    port = ENGINE1_PORT
    assert port != ENGINE_PORT
    return {
        **sections,
        "resident": {"units": [RESIDENT1], "props_url": f"http://127.0.0.1:{RESIDENT1_PORT}/props"},
        "resident.idle": {"url": f"http://127.0.0.1:{RESIDENT1_PORT}/slots"},
        "resident.verify": {"url": f"http://127.0.0.1:{RESIDENT1_PORT}/v1/chat/completions", "model": "strata1"},
        "timers": {"pause": []},
        "window": {"health_url": f"http://127.0.0.1:{port}/health"},
        "window.container": {"name": "hyperqwen1", "env": {
            **ENGINE_ENV, "PORT": str(port), "ENGINE_NAME": "hyperqwen1", "ENGINE_MODEL": "hyperqwen1",
            "GPUSIM_CARD": str(card), "ENGINE_BOOT_DELAY": "0.5"}},
        "window.verify": {"url": f"http://127.0.0.1:{port}/v1/chat/completions", "model": "hyperqwen1"},
    }
