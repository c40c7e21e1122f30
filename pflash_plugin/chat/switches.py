"""Per-request template switches: what a request asks of the model's thinking, in the variables
chat templates read (`enable_thinking`: Qwen3/3.5, DeepSeek V3.1, GLM, SmolLM3...; `reasoning_effort`:
gpt-oss), merged under the request's own `chat_template_kwargs`."""
from __future__ import annotations

from typing import Any

# what llama_cpp's Jinja2ChatFormatter passes the template itself: a request may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "tool_choice", "functions", "function_call", "bos_token",
                                      "eos_token", "add_generation_prompt", "raise_exception", "strftime_now"})

# OpenAI's efforts as gpt-oss's template knows them (low, medium, high)
_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


# llama-server's default for a template with thinking markers: it always sets enable_thinking (true
# unless reasoning is off), and the templates llama.cpp ships (DeepSeek R1 distills, V3.1, QwQ, MiniCPM,
# ...) think only when it is true; Qwen3's own test `enable_thinking is false`, which it leaves alone
THINKING_DEFAULT: dict[str, Any] = {"enable_thinking": True}


def reserved_keys(kwargs: dict[str, Any]) -> list[str]:
    """The keys of `kwargs` that name what the server passes the template itself."""
    return sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))


def template_kwargs(effort: str | None = None, thinking: bool | None = None,
                    explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    """The template variables of one request: OpenAI's `reasoning_effort` (none and minimal: no
    thinking, as llama-cpp-python's example Qwen3.5 template reads them; low on: thinking), or
    Anthropic's thinking switch, then the request's `chat_template_kwargs` over them."""
    out: dict[str, Any] = {}
    if effort is not None:
        out = {"enable_thinking": effort not in ("none", "minimal"), "reasoning_effort": _EFFORT.get(effort, effort)}
    if thinking is not None:
        out["enable_thinking"] = thinking
    return {**out, **(explicit or {})}
