"""Streamed chat completions as servers send them: server-sent events, usage, reasoning.

Pure parsing (no I/O): ``SseDecoder`` turns ``data:`` lines into JSON objects, and
``CompletionBuilder`` adds them up into a ``Completion`` whose token counts come only from the
server's final usage chunk. Malformed input is a ``BadResponse``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gpuswapd.errors import BadResponse

SNIPPET = 300


@dataclass(frozen=True)
class Completion:
    """One chat completion as it was streamed."""

    text: str
    reasoning: str
    finish_reason: str | None
    # From the final usage chunk only: speculative decoding puts several tokens in one chunk.
    prompt_tokens: int | None
    completion_tokens: int | None
    chunks: int
    ttft_s: float | None
    total_s: float
    # usage.completion_tokens_details.reasoning_tokens, where the server reports it.
    reasoning_tokens: int | None = None

    @property
    def answered(self) -> bool:
        """Tell whether the model gave an answer (not only reasoning)."""
        # Whitespace counts: it proves the server generates answer tokens (tiny test models
        # answer "\n\n..."); the failure that matters is reasoning with no answer at all.
        return bool(self.text)


class ServerFault(Exception):
    """The server failed mid-answer (error event, truncated stream): worth a retry."""


# -- server-sent events ------------------------------------------------------------------------


class SseDecoder:
    """Turn server-sent event lines into JSON objects, one line at a time."""

    def __init__(self, where: str = "stream") -> None:
        self.done = False
        self.where = where
        self._data: list[str] = []
        self._event = ""

    def line(self, line: str) -> list[dict[str, Any]]:
        """Take one line (without its line break); return the events it completes."""
        if self.done:
            return []
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch(strict=True)
        if line.startswith(":"):  # a comment: keep-alives
            return []
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
            # Some servers omit the blank line between events: an object is complete when it parses.
            return self._dispatch(strict=False)
        elif name == "error":
            # llama.cpp sends a failure mid-stream as an `error: {...}` line (server_sent_event).
            out = self._dispatch(strict=True)
            self._data, self._event = [value], "error"
            return out + self._dispatch(strict=True)
        return []  # id:, retry:, and fields nobody defined

    def end(self) -> list[dict[str, Any]]:
        """Flush the last event when the stream ends without a blank line."""
        return [] if self.done else self._dispatch(strict=True)

    def _dispatch(self, *, strict: bool) -> list[dict[str, Any]]:
        raw = "\n".join(self._data).strip()
        if not raw:
            self._data, self._event = [], ""
            return []
        if raw == "[DONE]":
            self.done = True
            return []
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            if not strict:
                return []  # perhaps an object spread over several data: lines
            if self._event == "error":
                obj = {"message": raw}
            else:
                raise BadResponse(f"{self.where}: an event is not JSON: {snip(raw)}") from None
        event, self._data, self._event = self._event, [], ""
        if event == "error" and not (isinstance(obj, dict) and "error" in obj):
            obj = {"error": obj}
        if not isinstance(obj, dict):
            raise BadResponse(f"{self.where}: an event is not a JSON object: {snip(raw)}")
        return [obj]


def parse_sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a server-sent event stream, up to ``data: [DONE]``."""
    decoder = SseDecoder()
    for line in lines:
        yield from decoder.line(line)
        if decoder.done:
            return
    yield from decoder.end()


# -- completions -------------------------------------------------------------------------------


class CompletionBuilder:
    """Collect a streamed chat completion's chunks into a ``Completion``."""

    def __init__(self, started: float, where: str = "stream") -> None:
        self.started = started
        self.where = where
        self.chunks = 0
        self.finish_reason: str | None = None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._usage: dict[str, Any] | None = None
        self._first: float | None = None

    def add(self, chunk: dict[str, Any], at: float) -> None:
        """Take one chunk that arrived at monotonic time ``at``; raise on an error chunk."""
        error = chunk.get("error")
        if error is not None:
            message = f"{self.where}: the server failed mid-stream: {error_text(chunk)}"
            code = error.get("code") if isinstance(error, dict) else None
            if isinstance(code, int) and code < 500:
                raise BadResponse(message)
            raise BadResponse(message) from ServerFault()
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = chunk.get("choices")
        carried = False
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            part = choice.get("delta")
            if not isinstance(part, dict):
                part = choice.get("message")  # a non-streamed answer
            if isinstance(part, dict):
                carried |= self._take(part)
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        if carried:
            self.chunks += 1
            if self._first is None:
                self._first = at

    def _take(self, delta: dict[str, Any]) -> bool:
        content = delta.get("content")
        # vLLM >= 0.16 says `reasoning`; older vLLM and llama.cpp say `reasoning_content`.
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        carried = False
        if isinstance(content, str) and content:
            self._text.append(content)
            carried = True
        if isinstance(reasoning, str) and reasoning:
            self._reasoning.append(reasoning)
            carried = True
        return carried

    @property
    def ttft_s(self) -> float | None:
        """Seconds from the request to the first content or reasoning token."""
        return None if self._first is None else self._first - self.started

    def build(self, at: float) -> Completion:
        """Return the completion as of monotonic time ``at``."""
        usage = self._usage or {}
        details = usage.get("completion_tokens_details")
        return Completion(
            text="".join(self._text),
            reasoning="".join(self._reasoning),
            finish_reason=self.finish_reason,
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_count(usage.get("completion_tokens")),
            chunks=self.chunks,
            ttft_s=self.ttft_s,
            total_s=at - self.started,
            reasoning_tokens=_count(details.get("reasoning_tokens")) if isinstance(details, dict) else None,
        )


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- Prometheus text format --------------------------------------------------------------------

def message_of(text: str) -> str:
    """Say what an error body says: OpenAI, llama-swap and FastAPI shapes, or the text."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return snip(text)
    return snip(error_text(body)) if isinstance(body, dict) else snip(text)


def error_text(body: dict[str, Any]) -> str:
    """Dig the message out of ``{"error": {"message"}}``, ``{"error": "..."}`` or ``{"detail"}``."""
    for key in ("error", "detail", "message"):
        value = body.get(key)
        if isinstance(value, dict):
            inner = value.get("message") or value.get("msg")
            kind = value.get("type")
            if isinstance(inner, str):
                prefix = f"{kind}: " if isinstance(kind, str) and kind not in inner else ""
                return prefix + inner
            return json.dumps(value)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return "; ".join(str(v.get("msg", v)) for v in value if isinstance(v, dict))
        if isinstance(value, str) and value:
            return value
    return "" if not body else json.dumps(body)


def snip(text: str | bytes) -> str:
    """Shorten a server's text to one line of at most ``SNIPPET`` characters, for messages."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[: SNIPPET - 1] + "…"
