"""``gpuswapctl bench`` against the real gpuswapd and the engine simulator of the test world."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuswapd.ctl.bench import CHAT_PROMPTS
from tests.stack.daemon import RunningDaemon
from tests.stack.world import ENGINE_PORT

Start = Callable[..., RunningDaemon]
ENGINE_URL = f"http://127.0.0.1:{ENGINE_PORT}/v1/chat/completions"


def direct_usage(prompt: str, max_tokens: int) -> dict[str, Any]:
    """Ask the simulator itself, streamed with include_usage, and return its final usage."""
    body = json.dumps({"model": "hyperqwen", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(ENGINE_URL, data=body, headers={"Content-Type": "application/json"})
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=30) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def bench(daemon: RunningDaemon, *args: str) -> tuple[int, dict[str, Any] | None, str]:
    out = daemon.ctl("bench", "--json", *args)
    report = json.loads(out.stdout) if out.stdout.strip() else None
    return out.returncode, report, out.stderr


def leases(daemon: RunningDaemon) -> list[str]:
    window = daemon.status()["window"]
    return [lease["holder"] for lease in window["leases"]] if window else []


def test_bench_counts_tokens_from_usage_warns_on_thinking_and_releases(gpuswapd: Start) -> None:
    daemon = gpuswapd()
    # A lease of our own keeps the window open after bench releases its one.
    daemon.ctl_json("acquire", "--for", "5m", "--holder", "test")

    code, report, err = bench(daemon, "--max-tokens", "256")
    assert code == 0, err
    assert report is not None and report["failed"] == 0 and report["lease"]["holder"] != "test"
    requests = report["requests"]
    assert [r["label"] for r in requests] == [p[:40] for p in CHAT_PROMPTS]
    for prompt, r in zip(CHAT_PROMPTS, requests, strict=True):
        usage = direct_usage(prompt, 256)
        assert r["completion_tokens"] == usage["completion_tokens"] == 8 + 12  # reasoning + answer
        assert r["prompt_tokens"] == usage["prompt_tokens"]
        assert 0 < r["chunks"] < r["completion_tokens"]  # three tokens per SSE chunk
        assert r["tokens_per_chunk"] == r["completion_tokens"] / r["chunks"]
        assert r["reasoning_counted_by"] == "estimate" and 0 < r["reasoning_tokens"] < r["completion_tokens"]
        assert r["ttft_s"] > 0 and r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["warnings"] == []
    assert report["summary"]["completion_tokens"] == {"n": 5, "mean": 20.0, "min": 20, "max": 20}
    assert leases(daemon) == ["test"]

    code, report, err = bench(daemon, "--max-tokens", "4")
    assert code == 0, err
    assert report is not None
    assert all(r["finish_reason"] == "length" and r["completion_tokens"] == 4 for r in report["requests"])
    assert all("raise --max-tokens" in w for r in report["requests"] for w in r["warnings"])
    assert "thinking ate the whole budget" in err and "raise --max-tokens" in err
    assert leases(daemon) == ["test"]

    daemon.ctl("release", "--holder", "test", check=True)
    daemon.wait_phase("IDLE")


def test_bench_rejects_a_malformed_jsonl_line_before_taking_the_gpu(gpuswapd: Start, tmp_path: Path) -> None:
    daemon = gpuswapd()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hello.", "max_tokens": 32}\n\n{"prompt": "unterminated\n')
    code, report, err = bench(daemon, "--prompts", str(prompts))
    assert code == 2 and report is None
    assert f"{prompts} line 3: not JSON" in err
    status = daemon.status()
    assert status["phase"] == "IDLE" and status["last"] is None
