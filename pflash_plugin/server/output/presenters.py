"""How one API shows a generation: its whole body, or its stream of SSE events. dispatch.py runs
every generation the same way and asks a presenter for the shapes, so an API with its own
streaming shape (OpenAI chat and completions, the Responses API, Anthropic's Messages) is one
presenter and one route.

A presenter is made per request and may keep state across its calls (sequence numbers, the open
content block). SSE items are sse-starlette's dicts: `{"data": ...}`, with `"event"` for named events.
"""
from __future__ import annotations

import json
from typing import Any, Protocol

from starlette.responses import JSONResponse

from ...engine.request import ErrorEvent, FinishEvent, TextEvent
from ..runtime.generation import Generation
from ..wire.errors import error_response, http_of
from ..wire.protocol import error_body
from ..wire.responses import envelope
from ..wire.usage import Totals, openai_usage, reasoning_tokens

Sse = dict[str, str]


def sse(body: Any, event: str | None = None) -> Sse:
    """One SSE item: a JSON body, named by `event` when the API names its events."""
    item = {"data": json.dumps(body)}
    if event is not None:
        item["event"] = event
    return item


class Presenter(Protocol):
    """One API's shapes for one generation. A body is built from the choices' whole outputs
    (`finals`, from Choice.final), their engine ends (`ends`: reason, stop string) and their merged
    usage, as dispatch.py collects them."""

    def head(self) -> list[Sse]:
        """The events sent before any token."""

    def delta(self, index: int, event: TextEvent) -> list[Sse]:
        """The events for text of choice `index`."""

    def finish(self, index: int, event: FinishEvent) -> list[Sse]:
        """The events for the end of choice `index`."""

    def done(self, usage: Totals) -> list[Sse]:
        """The events after every choice finished."""

    def stream_error(self, event: ErrorEvent) -> list[Sse]:
        """The events that end a stream a request failed in."""

    def body(self, finals: list[dict], ends: list[FinishEvent], usage: Totals) -> dict | list[dict]:
        """The whole answer, not streamed (llama-server's for several prompts: a list)."""

    def error(self, event: ErrorEvent) -> JSONResponse:
        """The answer when a request failed before a non-streamed answer was complete."""


class ChatPresenter:
    """OpenAI's chat completions and completions: `choices` in an envelope, chunks ending with [DONE]."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    def _usage(self, usage: Totals) -> dict[str, Any]:
        chat = self.gen.object == "chat.completion"
        return openai_usage(usage, reasoning_tokens(self.gen.choices) if chat else None)

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> Sse:
        return sse(envelope(self.gen.rid, self.gen.chunk_object, self.gen.served.name, choices, usage))

    def head(self) -> list[Sse]:
        return [self._chunk([h]) for h in (c.head() for c in self.gen.choices) if h is not None]

    def delta(self, index: int, event: TextEvent) -> list[Sse]:
        return [self._chunk([self.gen.choices[index].chunk(event.text, event.tokens, None)])]

    def finish(self, index: int, event: FinishEvent) -> list[Sse]:
        return [self._chunk([self.gen.choices[index].chunk("", [], event.reason)])]

    def done(self, usage: Totals) -> list[Sse]:
        # the usage chunk is the stream's too: the same id, as OpenAI sends it
        tail = [self._chunk([], self._usage(usage))] if self.gen.include_usage else []
        return [*tail, {"data": "[DONE]"}]

    def stream_error(self, event: ErrorEvent) -> list[Sse]:
        http = http_of(event.kind)
        return [sse(error_body(event.message, http.type, code=http.code))]

    def body(self, finals: list[dict], ends: list[FinishEvent], usage: Totals) -> dict:
        return envelope(self.gen.rid, self.gen.object, self.gen.served.name, finals, self._usage(usage))

    def error(self, event: ErrorEvent) -> JSONResponse:
        return openai_error(event)


def openai_error(event: ErrorEvent) -> JSONResponse:
    """A failed request's answer in OpenAI's error shape."""
    status, kind, code = http_of(event.kind)
    return error_response(status, event.message, kind, code=code)
