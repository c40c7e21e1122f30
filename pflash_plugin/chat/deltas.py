"""What a chat answer is made of, as typed deltas: answer text, reasoning text, tool calls. The
readers of the model's text (reasoning.py, the tool-call readers) produce them; each API's presenter
turns them into its own shapes (OpenAI chunks, Responses items, Anthropic blocks), so a new kind of
block is a new delta type and one branch per presenter, not a new key read out of OpenAI's dicts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class TextDelta:
    """Answer text (OpenAI's `content`)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking the model wrote before its answer (OpenAI's `reasoning_content`)."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of tool call `index` (its place among the answer's calls): its first delta names
    it (`id` and `name` set), later ones add to its arguments' JSON text."""

    index: int
    arguments: str = ""
    id: str = ""
    name: str = ""

    @property
    def opens(self) -> bool:
        return bool(self.id)


Delta = Union[TextDelta, ReasoningDelta, CallDelta]


def call_deltas(calls: list[dict]) -> list[CallDelta]:
    """OpenAI tool-call dicts (streamed deltas or whole calls, with their index) as CallDeltas."""
    out = []
    for call in calls:
        function = call.get("function") or {}
        out.append(CallDelta(call["index"], function.get("arguments") or "", call.get("id") or "",
                             function.get("name") or ""))
    return out


def merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent deltas of one kind (text after text, one call's pieces) as one: a whole answer's
    blocks, or fewer OpenAI chunk fields."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if isinstance(delta, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + delta.text)
        elif isinstance(delta, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + delta.text)
        elif isinstance(delta, CallDelta) and isinstance(last, CallDelta) and last.index == delta.index \
                and not delta.opens:
            out[-1] = CallDelta(last.index, last.arguments + delta.arguments, last.id, last.name)
        else:
            out.append(delta)
    return out
