"""llama-server's own completion shape, which its /completion and /infill answer in (server-task.cpp,
to_json_non_oaicompat): `content`, `tokens`, `stop`, `stop_type`, `tokens_predicted`, `timings`;
streamed, one `data:` event per piece of text and a last one with `stop: true`, and no [DONE].
Clients read `content` and, through `response_fields`, picked fields (llama.vim: "timings/prompt_n")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse

from ...engine.request import ErrorEvent, FinishEvent, TextEvent, TokenOutput, Usage
from ..runtime.generation import Generation
from ..wire.native import native_probs
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
    # the first token came with the prompt's last batch: the decode time is the steps of the others (llama-server's)
    predicted_per_token, predicted_per_second = _rate(max(usage.completion_tokens - 1, 0), predicted_ms)
    return {"cache_n": usage.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
            "predicted_n": usage.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}


def nested(fields: list[str] | None, body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's response_fields: each path's value under its path ("timings/prompt_n"),
    a path that is not in the body left out; None or none listed: the whole body."""
    if not fields:
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


@dataclass(frozen=True)
class NativeShape:
    """What a route adds to llama-server's answer: the fields picked, the request's settings
    (`generation_settings`), each prompt's text (`prompt`; none: left out)."""

    fields: list[str] | None = None
    settings: dict[str, Any] | None = None
    prompts: list[str] = field(default_factory=list)


def final(model: str, text: str, end: FinishEvent | None, prompt_tokens: int, shape: NativeShape,
          index: int = 0, choice: dict[str, Any] | None = None) -> dict[str, Any]:
    """An answer's last object: `text` all of it (streamed: "" after the pieces); `end` None for
    an answer of no tokens (n_predict 0), which the engine never ran; `choice` the whole choice,
    whose `tokens` and `completion_probabilities` it carries where the choice kept them."""
    usage = end.usage if end is not None else None
    stop_type = "limit" if end is None or end.reason == "length" else "word" if end.stop else "eos"
    kept = choice or {}
    body = {"index": index, "content": text, "tokens": kept.get("tokens", []), "stop": True, "model": model,
            "tokens_predicted": usage.completion_tokens if usage else 0,
            "tokens_evaluated": usage.prompt_tokens if usage else prompt_tokens,
            "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": (end.stop or "") if end is not None else "",
            "tokens_cached": usage.cached_tokens if usage else 0}
    if shape.settings is not None:
        body["generation_settings"] = shape.settings
    if index < len(shape.prompts):
        body["prompt"] = shape.prompts[index]
    if usage is not None:
        body["timings"] = timings(usage)
    if "completion_probabilities" in kept:
        body["completion_probabilities"] = kept["completion_probabilities"]
    return nested(shape.fields, body)


def answers(bodies: list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
    """One prompt's answer as an object, several prompts' as a list (llama-server's rule)."""
    return bodies[0] if len(bodies) == 1 else bodies


def unrun(model: str, prompt_tokens: list[int], shape: NativeShape, stream: bool) -> Any:
    """The answers to n_predict 0, which llama-server gives without generating: each prompt's
    empty last object, streamed or not."""
    bodies = [final(model, "", None, n, shape, i) for i, n in enumerate(prompt_tokens)]
    return EventSourceResponse(iter([sse(body) for body in bodies]), sep="\n") if stream else answers(bodies)


class NativePresenter:
    """Completions in llama-server's shape, one per prompt; `tokens` where return_tokens asks;
    `completion_probabilities` where `probs` (n_probs) asks: streamed, one event a token as
    llama-server sends them, the event's text on its last token."""

    def __init__(self, gen: Generation, shape: NativeShape, return_tokens: bool = False, probs: bool = False) -> None:
        self.gen, self.shape, self.return_tokens, self.probs = gen, shape, return_tokens, probs
        self.predicted = [0] * len(gen.requests)
        self.new_line = [False] * len(gen.requests)  # a streamed answer's text had one (its has_new_line)

    def _prompt_tokens(self, index: int) -> int:
        return len(self.gen.requests[index].prompt_tokens)

    def head(self) -> list[Sse]:
        return []

    def delta(self, index: int, event: TextEvent) -> list[Sse]:
        self.new_line[index] |= "\n" in event.text
        taken = [one for output in event.tokens for one in output.unrolled()]
        if not self.probs or not taken:
            return [self._piece(index, event.text, taken)]
        last = len(taken) - 1
        return [self._piece(index, event.text if i == last else "", [one],
                            native_probs(self.gen.served.model.piece, [one])) for i, one in enumerate(taken)]

    def _piece(self, index: int, text: str, taken: list[TokenOutput], probs: list[dict[str, Any]] | None = None) -> Sse:
        """One streamed event of the tokens `taken` (tokens_predicted counts them)."""
        self.predicted[index] += len(taken)
        ids = [one.token for one in taken] if self.return_tokens else []
        body = {"index": index, "content": text, "tokens": ids, "stop": False,
                "tokens_predicted": self.predicted[index], "tokens_evaluated": self._prompt_tokens(index)}
        return sse(body if probs is None else {**body, "completion_probabilities": probs})

    def finish(self, index: int, event: FinishEvent) -> list[Sse]:
        whole = NativeShape(None, self.shape.settings, self.shape.prompts)
        body = final(self.gen.served.name, "", event, self._prompt_tokens(index), whole, index)
        body["has_new_line"] = self.new_line[index]
        return [sse(nested(self.shape.fields, body))]

    def done(self, usage: Totals) -> list[Sse]:
        return []

    def stream_error(self, event: ErrorEvent) -> list[Sse]:
        return ChatPresenter(self.gen).stream_error(event)

    def body(self, finals: list[dict], ends: list[FinishEvent], usage: Totals) -> dict | list[dict]:
        return answers([final(self.gen.served.name, choice["text"], end, self._prompt_tokens(i), self.shape, i,
                              choice) for i, (choice, end) in enumerate(zip(finals, ends))])

    def error(self, event: ErrorEvent) -> JSONResponse:
        return openai_error(event)
