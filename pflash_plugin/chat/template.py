"""A model's Jinja chat template run as llama.cpp runs the templates real models ship
(common/chat.cpp, common/jinja/caps.cpp), where llama_cpp's formatter (transformers' rules) refused
them: walked over llama.cpp's models/templates, 31 of 70 failed a standard conversation.

- Earlier calls' arguments as the template reads them: OpenAI clients send them as JSON text; a
  template that iterates them (Qwen3.5's `arguments|items`, Laguna, MiniCPM5...) or writes them with
  `tojson` (which quoted the text once more) gets them as objects (llama.cpp's
  `supports_object_arguments`, found here by rendering a probe both ways).
- Call ids as the template takes them: Mistral's refuse ids that are not 9 letters or digits; an
  OpenAI id (`call_...`) is mapped to 9 characters, the same id to the same characters in the calls
  and their results.
- Lists a template builds with `append` (a sandbox still: no unsafe attribute), `from_json`
  (DeepSeek V3.2, V4), and a `tojson` that writes what a `map` filter made (llama.cpp's DeepSeek R1).
"""
from __future__ import annotations

import hashlib
import json
import string
import types
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment
from llama_cpp import llama_chat_format

_NEEDLE = "argument_needle_81"  # the probe's argument value
_PROBE_TOOL: Any = {"type": "function", "function": {"name": "tool1", "description": "Tool 1",
                                                "parameters": {"type": "object", "properties": {
                                                    "arg": {"type": "string", "description": "Arg"}},
                                                    "required": ["arg"]}}}
_ALNUM = string.ascii_letters + string.digits


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson, which also writes what a filter yields lazily (`map`) as a list."""
    def lazy(value: Any) -> Any:
        if isinstance(value, (types.GeneratorType, map, filter)):
            return list(value)
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=lazy)


class ChatTemplate(llama_chat_format.Jinja2ChatFormatter):
    """llama_cpp's Jinja formatter (same rendering, stop and BOS rules) with llama.cpp's allowances."""

    def __init__(self, template: str, eos_token: str, bos_token: str) -> None:
        super().__init__(template=template, eos_token=eos_token, bos_token=bos_token)
        env = self._environment.environment
        env.filters["tojson"] = _tojson
        env.filters["from_json"] = json.loads
        # a sandbox that lets a template build its own lists (llama.cpp's engine does)
        env.is_safe_attribute = types.MethodType(SandboxedEnvironment.is_safe_attribute, env)  # type: ignore
        self.object_arguments = self._wants_object_arguments()
        self.short_ids = self._wants_short_ids()

    def __call__(self, *, messages: Any, **kwargs: Any) -> Any:
        history: Any = self.history(messages)
        return super().__call__(messages=history, **kwargs)

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with their calls' arguments and ids as this template takes them."""
        if not (self.object_arguments or self.short_ids):
            return messages
        return [_adapted(m, self.object_arguments, self.short_ids) for m in messages]

    def _try(self, arguments: Any, call_id: str) -> str | None:
        """The probe call rendered, ending at its result or at a user turn after it (templates
        differ in which they take); None where the template takes neither."""
        probes: Any = _probes(arguments, call_id)
        for messages in probes:
            try:
                return str(super().__call__(messages=messages, tools=[_PROBE_TOOL]).prompt)
            except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError):
                continue
        return None

    def _wants_object_arguments(self) -> bool:
        """Whether the template renders a call's arguments given as an object, and fails on them
        as JSON text or writes that text as a JSON string (quoted once more)."""
        obj = self._try({"arg": _NEEDLE}, "call00001")
        if obj is None or _NEEDLE not in obj:
            return False
        text = self._try(json.dumps({"arg": _NEEDLE}), "call00001")
        return text is None or _NEEDLE not in text or '\\"arg\\"' in text

    def _wants_short_ids(self) -> bool:
        """Whether the template refuses an OpenAI call id and takes a 9-character one (Mistral's)."""
        arguments: Any = {"arg": _NEEDLE} if self.object_arguments else json.dumps({"arg": _NEEDLE})
        return self._try(arguments, "call_0123456789abcdef") is None and \
            self._try(arguments, "call00001") is not None


def _probes(arguments: Any, call_id: str) -> list[list[dict[str, Any]]]:
    call = {"id": call_id, "type": "function", "function": {"name": "tool1", "arguments": arguments}}
    turns: list[dict[str, Any]] = [{"role": "user", "content": "User message"},
                                   {"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": call_id, "content": "Tool response"}]
    return [turns, [*turns, {"role": "user", "content": "User message 2"}]]


def short_id(call_id: str) -> str:
    """An id of 9 letters and digits, the same for the same id (Mistral's templates refuse others)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(digest >> (6 * i)) % len(_ALNUM)] for i in range(9))


def _adapted(message: dict[str, Any], object_arguments: bool, short_ids: bool) -> dict[str, Any]:
    out = dict(message)
    if short_ids and isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = short_id(out["tool_call_id"])
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_call(c, object_arguments, short_ids) if isinstance(c, dict) else c for c in calls]
    return out


def _call(call: dict[str, Any], object_arguments: bool, short_ids: bool) -> dict[str, Any]:
    out = dict(call)
    if short_ids and isinstance(out.get("id"), str):
        out["id"] = short_id(out["id"])
    function = out.get("function")
    if object_arguments and isinstance(function, dict) and isinstance(function.get("arguments"), str):
        out["function"] = {**function, "arguments": _parsed(function["arguments"])}
    return out


def _parsed(arguments: str) -> Any:
    """The arguments' object; text that is not a JSON object stays text (the template may refuse it)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments

