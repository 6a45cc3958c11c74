"""The resident comes back warm on the real world: its slots saved before the stop, restored after the verify.

strata's llama-server has ``--slot-save-path`` (tests/stack/units.py), so gpuswapd keeps its slots
by default (resident.cache.keep = "auto"). An agent's context is prefilled once; after a window,
its next turn prefills only what is new (``timings.prompt_n``), as before the window.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import wait_for
from tests.stack import llama
from tests.stack.daemon import RunningDaemon
from tests.stack.world import RESIDENT_PORT, Stack

Start = Callable[..., RunningDaemon]


def agent_context(words: int = 1200) -> list[dict[str, str]]:
    """Return an agent's conversation: a long system prompt and a first question (about 1.5k tokens)."""
    system = " ".join(f"rule {i}: keep the file {i * 7 % 101} in order." for i in range(words // 8))
    return [{"role": "system", "content": system}, {"role": "user", "content": "What is rule 3?"}]


def chat(messages: list[dict[str, str]]) -> tuple[int, str]:
    """Ask strata itself (its own port) for a short answer; return the tokens it prefilled and its answer."""
    body = json.dumps({"model": "strata", "messages": messages, "max_tokens": 4, "temperature": 0,
                       "cache_prompt": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{RESIDENT_PORT}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return int(answer["timings"]["prompt_n"]), str(answer["choices"][0]["message"]["content"])


def turn(messages: list[dict[str, str]], said: str, question: str) -> list[dict[str, str]]:
    """Return the conversation with the answer and the agent's next question."""
    return [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": question}]


def cycle(daemon: RunningDaemon, during: Callable[[], None] | None = None) -> dict[str, Any]:
    """Open a window, do ``during`` while it is READY, close it; return its history record."""
    out = daemon.ctl("acquire", "--for", "5m")
    assert out.returncode == 0, out.stderr
    if during is not None:
        during()
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE", timeout=120)
    window: dict[str, Any] = daemon.ctl_json("history")["windows"][-1]
    return window


@contextlib.contextmanager
def long_answer() -> Iterator[None]:
    """Keep one of strata's slots processing a long answer (cut off when the window stops strata)."""
    def ask() -> None:
        body = json.dumps({"prompt": "Once upon a time", "n_predict": 3000, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{RESIDENT_PORT}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()

    def processing() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{RESIDENT_PORT}/slots", timeout=5) as resp:
            return any(s.get("is_processing") for s in json.loads(resp.read()))

    wait_for(processing, "a slot processing the long answer", 20)
    yield
    asker.join(60)


@pytest.fixture(autouse=True)
def no_stale_slot_files(world: Stack) -> None:
    """Start each test with an empty slot directory: what an earlier test's killed gpuswapd left is not this test's."""
    for path in Path(world.paths.slots).iterdir():
        path.unlink()


def slot_files(world: Stack) -> list[str]:
    """List the files in strata's slot save directory."""
    return sorted(p.name for p in Path(world.paths.slots).iterdir())


def test_an_agents_context_is_saved_before_the_stop_and_restored_after_the_verify(
        world: Stack, gpuswapd: Start) -> None:
    daemon = gpuswapd()
    messages = agent_context()
    whole, said = chat(messages)
    assert whole > 1000  # the whole context, prefilled once
    messages = turn(messages, said, "And rule 4?")
    before, said = chat(messages)
    assert before < 100  # the next turn: only what is new

    during: list[str] = []
    window = cycle(daemon, lambda: during.extend(slot_files(world)))
    assert during, "no slot file while the window was READY"
    cache = window["cache"]
    assert cache["outcome"] == "saved" and cache["dir"] == str(world.paths.slots), cache
    assert cache["tokens"] >= whole and cache["bytes"] > 0
    restore = cache["restore"]
    assert restore["outcome"] == "restored" and restore["tokens"] == cache["tokens"], restore
    assert window["outcome"] == "closed" and window["degraded"] is None and window["restored"] == "as_it_was"

    after, _ = chat(turn(messages, said, "And rule 5?"))
    assert after < 100, f"the first turn after the window prefilled {after} tokens (before it: {before})"
    assert slot_files(world) == []  # no slot file outlives its window


def test_a_changed_model_between_save_and_restore_skips_the_restore(world: Stack, gpuswapd: Start) -> None:
    daemon = gpuswapd()
    messages = agent_context()
    _, said = chat(messages)

    def replace_model() -> None:  # the operator puts another GGUF where strata's -m points
        assert world.use_model(llama.ensure_model(world.cache, "slow"))

    window = cycle(daemon, replace_model)
    cache = window["cache"]
    assert cache["outcome"] == "saved" and cache["restore"]["outcome"] == "mismatch", cache
    assert "is not the one that saved its slots" in cache["restore"]["reason"]
    assert window["outcome"] == "closed" and window["degraded"] is None
    after, _ = chat(turn(messages, said, "And rule 4?"))
    assert after > 1000  # cold: nothing of the other model's cache went into it
    assert slot_files(world) == []


def test_a_save_past_its_deadline_is_skipped_and_the_window_opens(world: Stack, gpuswapd: Start) -> None:
    # The slow model, busy with a long answer: llama-server saves a slot only once it is idle.
    world.use_model(llama.ensure_model(world.cache, "slow"))
    world.restart_resident()
    daemon = gpuswapd(resident__idle={"kind": "none"}, resident__cache={"save_timeout": "0.5s"})
    with long_answer():
        out = daemon.ctl("acquire", "--for", "5m")
        assert out.returncode == 0, out.stderr
    assert daemon.ctl("release").returncode == 0
    daemon.wait_phase("IDLE", timeout=120)
    window = daemon.ctl_json("history")["windows"][-1]
    cache = window["cache"]
    assert cache["outcome"] == "timeout" and "save_timeout = 0.5s" in cache["reason"], cache
    assert cache["save_s"] < 2 and "restore" not in cache
    assert "READY" in [t["phase"] for t in window["timings"]] and window["outcome"] == "closed"
    assert slot_files(world) == []


def test_a_failed_restore_leaves_the_resident_serving_and_the_window_closed_normally(
        world: Stack, gpuswapd: Start) -> None:
    daemon = gpuswapd()
    messages = agent_context()
    _, said = chat(messages)

    def damage() -> None:  # the disk loses the files' contents while the window runs
        files = slot_files(world)
        assert files
        for name in files:
            (world.paths.slots / name).write_bytes(b"not a slot")

    window = cycle(daemon, damage)
    restore = window["cache"]["restore"]
    assert restore["outcome"] == "failed" and "Unable to restore slot" in restore["reason"], restore
    assert window["outcome"] == "closed" and window["degraded"] is None and window["error"] is None
    assert "DEGRADED" not in [t["phase"] for t in window["timings"]]
    after, _ = chat(turn(messages, said, "And rule 4?"))  # serving, cold
    assert after > 1000
    assert slot_files(world) == []
