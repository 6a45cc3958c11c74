"""One agent job, as an agent timer's oneshot service runs it.

    agent_job.py --url http://127.0.0.1:8090/v1/chat/completions --model strata --name NAME
                 [--hold-file PATH] [--retry-for 2] [--timeout 300]

Sends one real chat completion (non-streaming, max_tokens 16), retrying only connection errors
for ``--retry-for`` seconds; prints one line of what it got. Exits 1 with a clear message if the
request fails. Then, if ``--hold-file`` exists and holds a number N, sleeps N seconds (so a test
can make a job "run" for N seconds) and exits 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def complete(url: str, model: str, name: str, retry_for: float, timeout: float) -> dict[str, Any]:
    """POST one completion; retry connection errors only; raise RuntimeError on failure."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Agent {name} checking in. Say hello."}],
            "max_tokens": 16,
        }
    ).encode()
    deadline = time.monotonic() + retry_for
    while True:
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                reply: dict[str, Any] = json.loads(resp.read())
                return reply
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {e.code} from {url}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, http.client.RemoteDisconnected) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or time.monotonic() >= deadline:
                raise RuntimeError(f"cannot reach {url}: {reason}") from None
            time.sleep(0.2)
        except (TimeoutError, ValueError, http.client.HTTPException) as e:
            raise RuntimeError(f"bad or no answer from {url}: {e!r}") from None


def hold_seconds(path: str | None) -> float:
    """The number of seconds in the hold file, or 0."""
    if not path:
        return 0.0
    try:
        return max(0.0, float(Path(path).read_text(encoding="utf-8").strip()))
    except (OSError, ValueError):
        return 0.0


def main(argv: list[str] | None = None) -> int:
    """Run the job."""
    parser = argparse.ArgumentParser(description="one agent job: a chat completion")
    parser.add_argument("--url", default="http://127.0.0.1:8090/v1/chat/completions")
    parser.add_argument("--model", default="strata")
    parser.add_argument("--name", required=True)
    parser.add_argument("--hold-file")
    parser.add_argument("--retry-for", type=float, default=2.0, help="seconds")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        reply = complete(args.url, args.model, args.name, args.retry_for, args.timeout)
    except RuntimeError as e:
        print(f"agent {args.name}: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        choice = reply["choices"][0]
        content = choice["message"].get("content") or ""
        tokens = reply.get("usage", {}).get("completion_tokens")
        finish = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        print(
            f"agent {args.name}: FAILED: not a chat completion: {str(reply)[:300]}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(
        f"agent {args.name}: ok finish={finish} completion_tokens={tokens} "
        f"content={content[:80]!r}",
        flush=True,
    )
    seconds = hold_seconds(args.hold_file)
    if seconds:
        print(f"agent {args.name}: holding for {seconds:g}s", flush=True)
        time.sleep(seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
