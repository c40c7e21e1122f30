"""Conversations as clients send them, shaped for templates that take less: consecutive messages
of one role merged into one turn (a tool result then the user's text, two user messages in a row)
where the template demands alternating turns, a missing or null content (an assistant's calls, as
OpenAI clients send them) as empty text where the template cannot take none, and a final assistant
message continued (Anthropic's prefill, vLLM's continue_final_message) instead of closed.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")

_MERGED_ROLES = ("system", "user", "assistant")  # tool results answer one call each: never merged


def merged_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive messages of one role as one message, their texts a paragraph each (as
    Anthropic merges consecutive user or assistant turns); an assistant's calls are kept in order."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if previous is None or not _mergeable(previous, message):
            merged.append(message)
            continue
        texts = [t for t in (previous.get("content"), message.get("content")) if t]
        joined = {**previous, "content": "\n\n".join(texts)}
        calls = [*(previous.get("tool_calls") or []), *(message.get("tool_calls") or [])]
        if calls:
            joined["tool_calls"] = calls
        merged[-1] = joined
    return merged


def _mergeable(first: dict[str, Any], second: dict[str, Any]) -> bool:
    role = first.get("role")
    return (role == second.get("role") and role in _MERGED_ROLES
            and all(isinstance(m.get("content"), (str, type(None))) for m in (first, second)))


def shaped_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages' merged turns, each content text (a missing or null one empty)."""
    return [m if isinstance(m.get("content"), (str, list)) else {**m, "content": ""} for m in merged_turns(messages)]


def folded_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system prompt as the first user turn's opening paragraph, for a template with no system
    role (Gemma 2's refuses one; llama.cpp's `supports_system_role` workaround does the same)."""
    if not messages or messages[0].get("role") != "system" or not isinstance(messages[0].get("content"), str):
        return messages
    system, rest = messages[0]["content"], messages[1:]
    at = next((i for i, m in enumerate(rest) if m.get("role") == "user" and isinstance(m.get("content"), str)), None)
    if at is None:
        return [{"role": "user", "content": system}, *rest]
    first = rest[at]
    return [*rest[:at], {**first, "content": f"{system}\n\n{first['content']}".strip()}, *rest[at + 1:]]


def render_merging(render: Callable[[list[dict[str, Any]]], T], messages: list[dict[str, Any]]) -> T:
    """`render(messages)`; where the template refuses them, `render` of their shaped turns, then of
    those with the system prompt folded into the first user turn (only then: a template that takes
    consecutive turns, null contents or a system role renders them as sent). The template's first
    error stands when shaping changes nothing or does not help."""
    try:
        return render(messages)
    except Exception as error:
        first = error
    shaped = shaped_turns(messages)
    for attempt in (shaped, folded_system(shaped)):
        if attempt == messages:
            continue
        try:
            return render(attempt)
        except Exception:
            continue
    raise first


def continued_text(messages: list[dict[str, Any]]) -> str | None:
    """The text a final assistant message says, which the answer continues (None: the answer
    opens a new turn). A message of calls, or of blank text, is a turn that ended."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content")
    return content if isinstance(content, str) and content.strip() else None


def cut_after(rendered: str, text: str) -> str | None:
    """The rendered conversation up to the end of its final message's `text`, before the template
    closes that turn (as transformers' continue_final_message cuts it: where the template trimmed
    the text's trailing space, the cut is after the trimmed text); None where the template did not
    render the text."""
    at = rendered.rfind(text.strip())
    if at < 0:
        return None
    kept = text.lstrip()
    if rendered.startswith(kept, at):
        return rendered[:at + len(kept)]
    return rendered[:at + len(text.strip())]
