"""An agent's next turn after a window, with the resident's slots kept and without, alternating in one run.

    .venv/bin/python -m tests.benchmarks.warm_bench [--cycles 10] [--words 1600] [--lag S] [--boot-delay S]

On the test world, strata serves the "slow" random-weight model (tests/stack/llama.py: 8 layers,
512 wide) with two slots of 4096 tokens and ``--slot-save-path``. Two gpuswapd configurations
take turns on one socket and state, the daemon restarted between them:

- **kept**: ``[resident.cache] keep = "auto"`` (the default where llama-server has a save path):
  the slots are saved before the stop and restored after the verify.
- **cold**: ``keep = "off"``: the resident comes back with empty slots.

Each cycle runs each variant once, in turn, from a fresh agent: its context (a system prompt of
``--words`` words, 2-4k tokens) is prefilled once (``whole``); its next turn is timed (``before``:
only the new tokens); a window opens and closes (acquire, release); the turn after is timed
(``after``). Each turn is a request straight to llama-server of one token (``max_tokens`` 1), so
its wall time is the time to the first token; its ``timings.prompt_n`` says what it prefilled.
The window's record gives the save's and the restore's seconds and bytes (llama-server's own
milliseconds per file for the rates), and the phases' seconds (what the save adds to
STOPPING_RESIDENT, the restore to RESTORING).

What bounds the result (this machine and the world's model, not gpuswapd):
  - the CPU's prefill rate of the slow model (2 threads): what a cold turn costs;
  - the KV cache's size per token of that model (8 layers x 512 x 2 x f16 = 16 KiB), and the
    disk's write and read rates for the slot files (the page cache, mostly, on this machine);
  - the VRAM release lag (0.5 s, or --lag) and the engine's boot (--boot-delay): the same for both.

Results: a table on stdout and JSON in /var/tmp/gpuswapd-bench/.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.benchmarks.clients import Events, Ready, acquire, release
from tests.benchmarks.report import (
    SPREAD_HEADER,
    add_world_options,
    alternate,
    figure,
    measured,
    paired,
    parser,
    spread,
    spread_row,
    table,
    write_results,
)
from tests.benchmarks.swap_bench import engine_env, phase_times, status, world, world_constants
from tests.stack import llama
from tests.stack.config import stack_config
from tests.stack.daemon import RunningDaemon
from tests.stack.world import RESIDENT_PORT, Stack, StackError

HOLDER = "warm-bench"
VARIANTS = ("kept", "cold")
MiB = 1 << 20
# The seed's agent: a 29k-token context, prefilled at ~250 tokens/s on the reference card, by a
# 27B-class model with grouped-query attention: 64 layers x 8 KV heads x 128 x (K and V) x 2 bytes.
SEED_TOKENS = 29_000
SEED_PREFILL_TPS = 250.0
SEED_KV_PER_TOKEN = 64 * 8 * 128 * 2 * 2  # 256 KiB


def agent(words: int, seed: int) -> list[dict[str, str]]:
    """Return a fresh agent's conversation: its long system prompt (its own, per cycle) and a question."""
    rules = " ".join(f"rule {i}: file {(i * 7 + seed) % 1009} goes to shelf {(i * 13 + seed) % 97}."
                     for i in range(words // 9))
    return [{"role": "system", "content": f"agent {seed}. {rules}"}, {"role": "user", "content": "What is rule 3?"}]


def ask(messages: list[dict[str, str]]) -> tuple[float, int, str]:
    """Ask strata itself for one token; return the wall seconds, the tokens it prefilled, and the answer."""
    body = json.dumps({"model": "strata", "messages": messages, "max_tokens": 1, "temperature": 0,
                       "cache_prompt": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{RESIDENT_PORT}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
    return time.monotonic() - started, int(answer["timings"]["prompt_n"]), answer["choices"][0]["message"]["content"]


def turn(messages: list[dict[str, str]], said: str, question: str) -> list[dict[str, str]]:
    """Return the conversation with the answer and the next question."""
    return [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": question}]


class Bench:
    """The world with the slow model, and the daemon of the variant now running."""

    def __init__(self, stack: Stack, configs: dict[str, Path], socket: Path, words: int) -> None:
        self.stack, self.configs, self.socket, self.words = stack, configs, socket, words
        self.daemon: RunningDaemon | None = None
        self.events: Events | None = None
        self.variant = ""
        self.cycles = 0

    def use(self, variant: str) -> None:
        """Make sure gpuswapd runs with this variant's configuration (restart it if not), at the baseline."""
        self.stack.wait_baseline()
        if self.variant != variant:
            self.stop()
            self.daemon = RunningDaemon(self.stack, self.configs[variant], self.socket).start()
            self.events = Events(self.socket)
            self.variant = variant

    def cycle(self, variant: str) -> dict[str, Any]:
        """A fresh agent's context, its next turn, a window, the turn after; return the figures."""
        assert self.daemon is not None and self.events is not None and self.variant == variant
        self.cycles += 1
        messages = agent(self.words, self.cycles)
        whole_s, whole_n, said = ask(messages)
        messages = turn(messages, said, "And rule 4?")
        before_s, before_n, said = ask(messages)
        opened = time.monotonic()
        Ready(self.socket).send(acquire(HOLDER))
        open_s = time.monotonic() - opened
        self.events.clear()
        released = time.monotonic()
        Ready(self.socket).send(release(HOLDER))
        finished, event = self.events.finished()
        close_s = finished - released
        last = status(self.socket)["last"]
        if last["id"] != event["window"] or last["outcome"] != "closed" or last["error"]:
            raise StackError(f"the window did not close cleanly: {last['outcome']} {last['error']}\n"
                             f"{self.daemon.tail()}")
        after_s, after_n, _ = ask(turn(messages, said, "And rule 5?"))
        cache = last.get("cache") or {}
        restore = cache.get("restore") or {}
        if variant == "kept" and restore.get("outcome") != "restored":
            raise StackError(f"the slots were not kept: {cache}\n{self.daemon.tail()}")
        if variant == "cold" and last.get("cache") is not None:
            raise StackError(f"keep = \"off\" kept the slots: {cache}")
        files = [f for f in cache.get("files", []) if isinstance(f, dict)]
        phases = phase_times(last)
        return {"whole_s": whole_s, "whole_n": whole_n, "before_s": before_s, "before_n": before_n,
                "after_s": after_s, "after_n": after_n, "open_s": open_s, "close_s": close_s,
                "stopping_s": phases.get("STOPPING_RESIDENT"), "restoring_s": phases.get("RESTORING"),
                "save_s": cache.get("save_s"), "restore_s": restore.get("restore_s"),
                "bytes": cache.get("bytes"), "tokens": cache.get("tokens"),
                "save_ms": sum(float(f.get("ms") or 0) for f in files),
                "restore_ms": sum(float(s.get("ms") or 0) for s in restore.get("slots", [])),
                "restored_bytes": restore.get("bytes")}

    def stop(self) -> None:
        """Stop the running gpuswapd (the window is closed: nothing is left)."""
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None
        self.variant = ""


def run(cycles: int, words: int, lag: float | None = None, boot_delay: float | None = None) -> dict[str, Any]:
    """Put the slow model under strata, then alternate the two variants."""
    stack = world(lag)
    result: dict[str, Any] = {}
    with stack.exclusive():
        stack.up()
        model_file = llama.ensure_model(stack.cache, "slow")
        stack.use_model(model_file)
        try:
            stack.restart_resident()
            home = stack.paths.root / "gpuswapd" / "warm-bench"
            shared = {"socket": str(home / "gpuswapd.sock"), "state_dir": str(home / "state"), "linger": "0s"}
            env = engine_env(boot_delay)
            configs = {variant: stack_config(stack, f"warm-bench-{variant}", daemon=shared,
                                             window__container={"env": env},
                                             resident__cache={"keep": "auto" if variant == "kept" else "off"},
                                             resident__verify={"max_tokens": 4, "prompt": "Say: ready"})
                       for variant in VARIANTS}
            bench = Bench(stack, configs, Path(shared["socket"]), words)
            try:
                result["constants"] = {**world_constants(stack, env, 2), "words": words,
                                       "model_bytes": model_file.stat().st_size, "model": str(model_file)}
                result["variants"] = alternate(cycles, [(v, lambda v=v: bench.cycle(v)) for v in VARIANTS],
                                               before=bench.use)
                result["ooms"] = stack.ooms()
                result["files_left"] = sorted(p.name for p in stack.paths.slots.iterdir())
            except StackError as err:
                tail = bench.daemon.tail(15) if bench.daemon is not None else ""
                raise StackError(f"{err}\ngpuswapd's log:\n{tail}") from err
            finally:
                bench.stop()
        finally:
            with contextlib.suppress(StackError):  # never hide what failed above
                stack.reset()  # the tiny model under strata again
    return result


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Compute every figure; the ratios per cycle."""
    kept, cold = result["variants"]["kept"], result["variants"]["cold"]

    def of(cycles: list[dict[str, Any]], key: str) -> list[float]:
        return [float(c[key]) for c in cycles if c.get(key) is not None]

    def rate(cycles: list[dict[str, Any]], nbytes: str, ms: str) -> list[float]:
        return [c[nbytes] / MiB / (c[ms] / 1000) for c in cycles if c.get(nbytes) and c.get(ms)]

    series = {
        "whole": of(kept + cold, "whole_s"), "whole_n": of(kept + cold, "whole_n"),
        "before": of(kept + cold, "before_s"), "before_n": of(kept + cold, "before_n"),
        "after.kept": of(kept, "after_s"), "after.cold": of(cold, "after_s"),
        "after_n.kept": of(kept, "after_n"), "after_n.cold": of(cold, "after_n"),
        "kept_vs_before": paired(of(kept, "after_s"), of(kept, "before_s"), lambda a, b: a / b),
        "cold_vs_kept": paired(of(cold, "after_s"), of(kept, "after_s"), lambda a, b: a / b),
        "open.kept": of(kept, "open_s"), "open.cold": of(cold, "open_s"),
        "open.added": paired(of(kept, "open_s"), of(cold, "open_s"), lambda a, b: a - b),
        "close.kept": of(kept, "close_s"), "close.cold": of(cold, "close_s"),
        "save": of(kept, "save_s"), "restore": of(kept, "restore_s"),
        "mib": [b / MiB for b in of(kept, "bytes")], "tokens": of(kept, "tokens"),
        "save_mib_s": rate(kept, "bytes", "save_ms"), "restore_mib_s": rate(kept, "restored_bytes", "restore_ms"),
        "save_s_per_mib": [s / (b / MiB) for s, b in zip(of(kept, "save_s"), of(kept, "bytes"), strict=False) if b],
        "restore_s_per_mib": [s / (b / MiB) for s, b in
                              zip(of(kept, "restore_s"), of(kept, "restored_bytes"), strict=False) if b],
    }
    return {k: spread(values) for k, values in series.items()}


def seed_context(stats: dict[str, Any]) -> dict[str, float]:
    """What the measured rates mean for the seed's 29k-token agent (at the KV size per token assumed)."""
    size = SEED_TOKENS * SEED_KV_PER_TOKEN / MiB
    save = stats["save_mib_s"].get("median") or 0.0
    restore = stats["restore_mib_s"].get("median") or 0.0
    return {"prefill_s": SEED_TOKENS / SEED_PREFILL_TPS, "file_mib": size,
            "save_s": size / save if save else float("nan"), "restore_s": size / restore if restore else float("nan")}


def main(argv: list[str] | None = None) -> int:
    """Run the warm benchmark."""
    cli = parser("warm_bench", __doc__, cycles_of="kept and cold windows")
    add_world_options(cli)
    cli.add_argument("--words", type=int, default=1600, metavar="N",
                     help="words of the agent's system prompt (default 1600: about 2.5k tokens)")
    args = cli.parse_args(argv)
    result = measured("warm_bench", run, args.cycles, args.words, args.lag, args.boot_delay)
    if result is None:
        return 1
    stats = analyse(result)
    rows = [spread_row(label, stats[key]) for key, label in (
        ("whole_n", "the agent's context, prefilled once (tokens)"), ("whole", "its first turn (s)"),
        ("before", "TTFT of its next turn, before the window (s)"), ("before_n", "  prefilled (tokens)"),
        ("after.kept", "TTFT of the turn after the window, kept (s)"), ("after_n.kept", "  prefilled (tokens)"),
        ("after.cold", "TTFT of the turn after the window, cold (s)"), ("after_n.cold", "  prefilled (tokens)"),
        ("kept_vs_before", "kept after / before, per cycle (x)"), ("cold_vs_kept", "cold / kept after, per cycle (x)"),
        ("open.kept", "acquire to READY, kept (s)"), ("open.cold", "acquire to READY, cold (s)"),
        ("open.added", "kept - cold opening, per cycle (s)"),
        ("close.kept", "release to window_finished, kept (s)"), ("close.cold", "release to window_finished, cold (s)"),
        ("save", "the save, in all (s)"), ("restore", "the restore, in all (s)"),
        ("mib", "slot files (MiB)"), ("tokens", "tokens saved"),
        ("save_mib_s", "llama-server's save (MiB/s)"), ("restore_mib_s", "llama-server's restore (MiB/s)"),
        ("save_s_per_mib", "the save, in all, per MiB (s)"), ("restore_s_per_mib", "the restore, in all, per MiB (s)"))]
    k = result["constants"]
    print(table(f"\nAn agent's turn after a window, slots kept and not, {args.cycles} cycles, variants alternating; "
                f"the slow model ({k['model_bytes'] / 1e6:.0f} MB)", SPREAD_HEADER, rows))
    seed = seed_context(stats)
    print(f"\nthe seed's agent: {SEED_TOKENS} tokens at {SEED_PREFILL_TPS:g} tokens/s is {seed['prefill_s']:.0f}s of "
          f"prefill after every window, cold; at {SEED_KV_PER_TOKEN // 1024} KiB a token (64 layers x 8 KV heads x "
          f"128 x K,V x f16) its slot file is {seed['file_mib'] / 1024:.2f} GiB: {seed['save_s']:.1f}s to save and "
          f"{seed['restore_s']:.1f}s to restore at this machine's median rates "
          f"({figure(stats['save_mib_s'], ' MiB/s', 0)} save, {figure(stats['restore_mib_s'], ' MiB/s', 0)} restore)")
    if result.get("files_left"):
        print(f"WARNING: slot files left in the save directory: {result['files_left']}")
    if result.get("ooms"):
        print(f"WARNING: CUDA out-of-memory recorded by the ledger: {result['ooms']}")
    print(f"\nresults: {write_results('warm', {**result, 'stats': stats, 'seed': seed})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
