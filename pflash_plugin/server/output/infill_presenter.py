"""llama-server's own completion shape, which its /infill answers in (server-task.cpp,
to_json_non_oaicompat): `content`, `stop`, `stop_type`, `tokens_predicted`, `timings`; streamed,
one `data:` event per piece of text and a last one with `stop: true`, and no [DONE]. Editors read
`content` and, through `response_fields`, the timings (llama.vim: "timings/prompt_n", ...)."""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from ...engine.request import ErrorEvent, FinishEvent, TextEvent, Usage
from ..runtime.generation import Generation
from ..wire.usage import Totals
from .presenters import ChatPresenter, Sse, openai_error, sse


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second), 0.0 where nothing was timed."""
    return (ms / n if n else 0.0), (1000.0 * n / ms if ms else 0.0)


def timings(usage: Usage) -> dict[str, Any]:
    """llama-server's `timings` object from the engine's usage of one request."""
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    prompt_ms, predicted_ms = usage.latency.prefill_ms, usage.latency.decode_ms
    prompt_per_token, prompt_per_second = _rate(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = _rate(usage.completion_tokens, predicted_ms)
    return {"cache_n": usage.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
            "predicted_n": usage.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}


def nested(fields: list[str] | None, body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's response_fields: each path's value under its path ("timings/prompt_n"),
    a path that is not in the body left out; None: the whole body."""
    if fields is None:
        return body
    picked: dict[str, Any] = {}
    for path in fields:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked


def final(model: str, text: str, end: FinishEvent | None, prompt_tokens: int,
          fields: list[str] | None) -> dict[str, Any]:
    """The answer's last object: `text` all of it (streamed: "" after the pieces); `end` None for
    an answer of no tokens (n_predict 0), which the engine never ran."""
    usage = end.usage if end is not None else None
    stop_type = "limit" if end is None or end.reason == "length" else "word" if end.stop else "eos"
    body = {"index": 0, "content": text, "tokens": [], "stop": True, "model": model,
            "tokens_predicted": usage.completion_tokens if usage else 0,
            "tokens_evaluated": usage.prompt_tokens if usage else prompt_tokens,
            "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": (end.stop or "") if end is not None else "",
            "tokens_cached": usage.cached_tokens if usage else 0}
    if usage is not None:
        body["timings"] = timings(usage)
    return nested(fields, body)


class InfillPresenter:
    """One completion (llama-server's /infill takes one prompt) in llama-server's shape."""

    def __init__(self, gen: Generation, fields: list[str] | None) -> None:
        self.gen, self.fields = gen, fields
        self.predicted = 0
        self.new_line = False  # a streamed answer's text had one (the last object's has_new_line)

    def head(self) -> list[Sse]:
        return []

    def delta(self, index: int, event: TextEvent) -> list[Sse]:
        self.predicted += len(event.tokens)
        self.new_line |= "\n" in event.text
        return [sse({"index": index, "content": event.text, "tokens": [], "stop": False,
                     "tokens_predicted": self.predicted, "tokens_evaluated": self.gen.prompt_tokens})]

    def finish(self, index: int, event: FinishEvent) -> list[Sse]:
        body = final(self.gen.served.name, "", event, self.gen.prompt_tokens, None)
        body["has_new_line"] = self.new_line
        return [sse(nested(self.fields, body))]

    def done(self, usage: Totals) -> list[Sse]:
        return []

    def stream_error(self, event: ErrorEvent) -> list[Sse]:
        return ChatPresenter(self.gen).stream_error(event)

    def body(self, finals: list[dict], ends: list[FinishEvent], usage: Totals) -> dict:
        return final(self.gen.served.name, finals[0]["text"], ends[0], self.gen.prompt_tokens, self.fields)

    def error(self, event: ErrorEvent) -> JSONResponse:
        return openai_error(event)
