"""One client request as the engine runs it: prepared by prepare.py, answered by dispatch.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ...engine.request import Request as EngineRequest
from ..wire.responses import Choice
from .models import ServedModel


@dataclass
class Generation:
    """One client request as the engine runs it: engine request i feeds choice i."""

    served: ServedModel
    requests: list[EngineRequest]
    choices: Sequence[Choice]
    object: str  # "text_completion" | "chat.completion"
    chunk_object: str  # the object of streamed chunks
    prompt_tokens: int  # the client's prompts, each counted once
    include_usage: bool = False
    rid: str = ""
    done: set[int] = field(default_factory=set)  # choices whose request finished or failed
    compression_counted: bool = False  # the n choices share one compression: the metrics count it once
    clock: bool = False  # usage's timings carry the marks on the server's clock (--usage_clock)

    def cancel_unfinished(self) -> None:
        """Cancel every request not finished yet, once: the client left or its answer ended."""
        for index, request in enumerate(self.requests):
            if index not in self.done:
                self.done.add(index)
                self.served.engine.cancel(request)
