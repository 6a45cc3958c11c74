"""``gpuswapctl bench``: hold a lease and measure the window's engine with real streamed completions.

Every figure comes from what the server reports: tokens from the final usage chunk (never from
counting SSE chunks), time to the first token and to the end of the stream as this client saw
them. The endpoint is ``--url``/``--model``, else the daemon's ``[window.verify]`` (from ``status``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuswapd.adapters.openai import ModelHttp
from gpuswapd.adapters.streams import Completion
from gpuswapd.ctl.client import Client
from gpuswapd.ctl.lease import held_lease
from gpuswapd.errors import EndpointError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
BUILTIN_SETS = ("chat", "long-context")
REQUEST_TIMEOUT_S = 600.0
CHAT_PROMPTS = (
    "Say hello in one short sentence.",
    "What is the capital of France? Answer in one word.",
    "Give three tips for writing clear commit messages.",
    "Explain in two sentences what a GPU does that a CPU does not.",
    "Write a haiku about waiting for a model to load.",
)
METRICS = ("ttft_s", "prefill_tps", "decode_tps", "tokens_per_chunk", "prompt_tokens",
           "completion_tokens", "reasoning_tokens", "total_s")


class BenchUsageError(Exception):
    """The prompts or the endpoint cannot be used (a usage error, exit 2)."""


@dataclass(frozen=True)
class Prompt:
    """One request of a benchmark: its messages, a short label and its token budget."""

    label: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None


@dataclass
class Result:
    """What one request measured (``None`` where the server did not report enough)."""

    index: int
    label: str
    max_tokens: int
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    reasoning_counted_by: str | None = None  # "server" (usage), "estimate" (text share), "none"
    answer_tokens: int | None = None
    chunks: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    decode_s: float | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None
    tokens_per_chunk: float | None = None
    warnings: list[str] = field(default_factory=list)
    error: str | None = None


# -- prompts -------------------------------------------------------------------------------------


def long_document(words: int = 4000) -> tuple[str, str]:
    """Build a deterministic document of about ``words`` words and the sentence to quote from it."""
    subjects = ("The scheduler", "Each worker", "The ledger", "A watchdog", "The proxy", "Every timer",
                "The resident model", "The engine", "A lease holder", "The operator")
    verbs = ("records", "checks", "releases", "reports", "delays", "verifies", "restores", "counts")
    objects = ("the free memory", "its last heartbeat", "the pending jobs", "the stopped units",
               "a warm cache", "the exit code", "the phase timings", "every open connection")
    tails = ("before the window opens.", "after the container stops.", "while the timers sleep.",
             "once the driver agrees.", "within the configured bound.", "when nobody is waiting.")
    key = "The archivist stamped ledger page 4217 with the code word MARIGOLD at seven past nine."
    sentences: list[str] = []
    count, n = 0, 0
    while count < words:
        s = (f"{subjects[n % 10]} {verbs[(n * 3) % 8]} {objects[(n * 5 + n // 8) % 8]} "
             f"{tails[(n * 7 + n // 6) % 6]}")
        if n == 300:  # far from both ends: the model has to find it
            s = key
        sentences.append(s)
        count += len(s.split())
        n += 1
    paragraphs = [" ".join(sentences[i:i + 12]) for i in range(0, len(sentences), 12)]
    body = "\n\n".join(f"Section {i + 1}. {p}" for i, p in enumerate(paragraphs))
    return body, key


def builtin_prompts(name: str) -> list[Prompt]:
    """Return a built-in prompt set: ``chat`` or ``long-context``."""
    if name == "chat":
        return [Prompt(p[:40], [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    document, _ = long_document()
    question = ("Above is a long operations log. Quote, word for word, the one sentence that "
                "contains a code word, and say which section it is in.")
    content = f"{document}\n\n{question}"
    return [Prompt(f"long-context ({len(document.split())} words)", [{"role": "user", "content": content}])]


def load_jsonl(path: Path) -> list[Prompt]:
    """Read prompts from JSONL: ``prompt`` or ``messages``, optional ``max_tokens``, one object a line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BenchUsageError(f"cannot read prompts from {path}: {getattr(err, 'strerror', None) or err}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt_line(line, f"{path} line {number}"))
    if not prompts:
        raise BenchUsageError(f"{path} has no prompts: write one JSON object per line, e.g. "
                              '{"prompt": "Say hello.", "max_tokens": 64}')
    return prompts


def _prompt_line(line: str, where: str) -> Prompt:
    try:
        obj = json.loads(line)
    except ValueError as err:
        raise BenchUsageError(f"{where}: not JSON ({err}); write one object per line such as "
                              '{"prompt": "Say hello."}') from None
    if not isinstance(obj, dict):
        raise BenchUsageError(f"{where}: expected a JSON object with \"prompt\" or \"messages\", "
                              f"got {line.strip()[:60]}")
    unknown = set(obj) - {"prompt", "messages", "max_tokens"}
    if unknown:
        raise BenchUsageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                              "(known: prompt, messages, max_tokens)")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise BenchUsageError(f"{where}: \"max_tokens\" must be a positive integer, got {max_tokens!r}")
    if ("prompt" in obj) == ("messages" in obj):
        raise BenchUsageError(f"{where}: give exactly one of \"prompt\" (a string) or \"messages\" (a list)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise BenchUsageError(f"{where}: \"prompt\" must be a non-empty string")
        return Prompt(obj["prompt"][:40], [{"role": "user", "content": obj["prompt"]}], max_tokens)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        raise BenchUsageError(f"{where}: \"messages\" must be a non-empty list of "
                              '{"role": ..., "content": ...} objects')
    last = messages[-1].get("content")
    return Prompt(str(last)[:40] if isinstance(last, str) else f"{len(messages)} messages", messages, max_tokens)


def select_prompts(spec: str) -> list[Prompt]:
    """Pick the prompt set: a built-in name or a JSONL file."""
    if spec in BUILTIN_SETS:
        return builtin_prompts(spec)
    path = Path(spec)
    if not path.exists():
        raise BenchUsageError(f"--prompts {spec}: neither a built-in set ({', '.join(BUILTIN_SETS)}) "
                              "nor an existing JSONL file")
    return load_jsonl(path)


def endpoint(args: argparse.Namespace, socket: str) -> tuple[str, str]:
    """Return the chat completions URL and model: the flags, else the profile's ``verify`` (from ``status``).

    A bare profile has no engine to measure: that is a usage error.
    """
    profile = getattr(args, "profile", "default")
    if args.url and args.model and profile == "default":
        return args.url, args.model
    with Client(socket) as client:
        reply = client.request({"op": "status"})
    profiles = reply.get("profiles") or {"default": {"kind": "engine", "endpoint": reply["endpoint"]}}
    if profile not in profiles:
        raise BenchUsageError(f"no profile {profile!r}: gpuswapd has {', '.join(profiles)}")
    if profiles[profile]["kind"] == "bare":
        raise BenchUsageError(f"profile {profile!r} is bare: it has no engine to measure (bench an engine profile)")
    verify = profiles[profile]["endpoint"]
    return args.url or verify["url"], args.model or verify["model"]


# -- the lease -----------------------------------------------------------------------------------


# -- requests ------------------------------------------------------------------------------------


def measure(index: int, prompt: Prompt, max_tokens: int, reply: Completion) -> Result:
    """Turn one Completion into the benchmark's figures."""
    r = Result(index, prompt.label, max_tokens, finish_reason=reply.finish_reason,
               prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
               chunks=reply.chunks, ttft_s=reply.ttft_s, total_s=reply.total_s)
    if r.ttft_s is not None:
        r.decode_s = max(0.0, reply.total_s - r.ttft_s)
        if r.prompt_tokens is not None and r.ttft_s > 0:
            r.prefill_tps = r.prompt_tokens / r.ttft_s
    tokens = r.completion_tokens
    if tokens is None:
        r.warnings.append("the server sent no usage chunk: token figures are missing "
                          "(does it support stream_options.include_usage?)")
    else:
        if r.decode_s:
            r.decode_tps = tokens / r.decode_s
        if r.chunks:
            r.tokens_per_chunk = tokens / r.chunks
        if reply.reasoning_tokens is not None:
            r.reasoning_tokens, r.reasoning_counted_by = reply.reasoning_tokens, "server"
        elif reply.reasoning:
            share = len(reply.reasoning) / (len(reply.reasoning) + len(reply.text))
            r.reasoning_tokens, r.reasoning_counted_by = round(tokens * share), "estimate"
        else:
            r.reasoning_tokens, r.reasoning_counted_by = 0, "none"  # no reasoning text was streamed
        r.answer_tokens = tokens - r.reasoning_tokens
    if reply.finish_reason == "length" and not reply.answered:
        thought = "thinking ate the whole budget" if reply.reasoning else "no answer came"
        r.warnings.append(f"hit max_tokens = {max_tokens} before any answer ({thought}): raise --max-tokens")
    return r


async def run_requests(url: str, model: str, prompts: list[Prompt], max_tokens: int, repeat: int) -> list[Result]:
    """Send every prompt ``repeat`` times, one after another; a failed request is recorded, not fatal."""
    http = ModelHttp()
    results: list[Result] = []
    try:
        # Untimed: otherwise the first TTFT includes making the HTTP client and its connection.
        await http.health(url)
        for _ in range(repeat):
            for prompt in prompts:
                budget = prompt.max_tokens or max_tokens
                index = len(results) + 1
                try:
                    reply = await http.chat(url, model, prompt.messages, budget, REQUEST_TIMEOUT_S)
                except EndpointError as err:
                    results.append(Result(index, prompt.label, budget, error=err.message))
                    continue
                results.append(measure(index, prompt, budget, reply))
    finally:
        await http.aclose()
    return results


def summarize(results: list[Result]) -> dict[str, dict[str, float | int]]:
    """Return mean, min and max of each metric over the requests that report it."""
    out: dict[str, dict[str, float | int]] = {}
    for name in METRICS:
        values = [v for r in results if (v := getattr(r, name)) is not None]
        if values:
            out[name] = {"n": len(values), "mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out


# -- output --------------------------------------------------------------------------------------


def _num(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def print_table(url: str, model: str, lease: dict[str, Any] | None, results: list[Result],
                summary: dict[str, dict[str, float | int]]) -> None:
    """Print one row per request, the warnings and the summary."""
    held = f" under lease {lease['id']}" if lease else " (no lease)"
    print(f"bench: {len(results)} request{'s' if len(results) != 1 else ''} to {model} at {url}{held}")
    print(f"{'#':>3}  {'prompt':<40} {'prompt':>7} {'compl':>6} {'reason':>7} {'ttft':>7} "
          f"{'prefill':>9} {'decode':>8} {'tok/':>5}  finish")
    print(f"{'':>3}  {'':<40} {'tokens':>7} {'tokens':>6} {'tokens':>7} {'s':>7} {'tok/s':>9} "
          f"{'tok/s':>8} {'chunk':>5}")
    for r in results:
        if r.error:
            print(f"{r.index:>3}  {r.label:<40} FAILED: {r.error}")
            continue
        mark = "~" if r.reasoning_counted_by == "estimate" else " "
        print(f"{r.index:>3}  {r.label:<40} {_num(r.prompt_tokens):>7} {_num(r.completion_tokens):>6} "
              f"{_num(r.reasoning_tokens):>6}{mark} {_num(r.ttft_s, 3):>7} {_num(r.prefill_tps):>9} "
              f"{_num(r.decode_tps):>8} {_num(r.tokens_per_chunk, 2):>5}  {r.finish_reason or '-'}")
    if any(r.reasoning_counted_by == "estimate" for r in results):
        print("  ~ reasoning tokens estimated from the reasoning's share of the text (the server did not count them)")
    if summary:
        print(f"\n{'summary':<20} {'mean':>10} {'min':>10} {'max':>10}  (over n requests)")
        for name, s in summary.items():
            digits = 3 if name.endswith("_s") else 1
            print(f"{name:<20} {_num(s['mean'], digits):>10} {_num(s['min'], digits):>10} "
                  f"{_num(s['max'], digits):>10}  n={s['n']}")


def warn(results: list[Result]) -> None:
    """Print each request's warnings and failure on stderr."""
    for r in results:
        for w in r.warnings:
            print(f"gpuswapctl: warning: request {r.index} ({r.label}): {w}", file=sys.stderr)
        if r.error:
            print(f"gpuswapctl: request {r.index} ({r.label}) failed: {r.error}", file=sys.stderr)


# -- the command ---------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace, socket: str) -> int:
    """Run ``gpuswapctl bench``; return its exit code (lease errors propagate as GpuswapError)."""
    try:
        if args.max_tokens < 1 or args.repeat < 1:
            raise BenchUsageError("--max-tokens and --repeat must be at least 1")
        prompts = select_prompts(args.prompts)
        url, model = endpoint(args, socket)
    except BenchUsageError as err:
        print(f"gpuswapctl: {err}", file=sys.stderr)
        return EXIT_USAGE
    lease: dict[str, Any] | None = None
    if args.no_lease:
        results = asyncio.run(run_requests(url, model, prompts, args.max_tokens, args.repeat))
    else:
        acquire: dict[str, Any] = {"op": "acquire", **({"for": args.duration} if args.duration else {})}
        if args.profile != "default":
            acquire["profile"] = args.profile
        if args.priority:
            acquire["priority"] = args.priority
        with held_lease(socket, acquire, quiet=args.json) as lease:
            results = asyncio.run(run_requests(url, model, prompts, args.max_tokens, args.repeat))
    summary = summarize([r for r in results if r.error is None])
    failed = sum(r.error is not None for r in results)
    warn(results)
    if args.json:
        report = {"url": url, "model": model, "prompts": args.prompts, "lease": lease,
                  "requests": [asdict(r) for r in results], "summary": summary, "failed": failed,
                  "warnings": [f"request {r.index}: {w}" for r in results for w in r.warnings]}
        print(json.dumps(report, indent=2))
    else:
        print_table(url, model, lease, results, summary)
    return EXIT_FAILED if failed else EXIT_OK
