"""Stock llama_cpp.server's chat formats that name a vision handler (issue 46), served by the
batched engine: each is the model's projector (clip_model_path / --mmproj) and a template.

- `mtmd` and `gemma4` (llama_cpp's MTMDChatHandler) render with the GGUF's own chat template, as
  stock does: here that is chat_format unset.
- The LLaVA family's handlers (llava-1-5, obsidian, llava-1-6, moondream, nanollava,
  llama-3-vision-alpha, minicpm-v-2.6, qwen2.5-vl) render with the handler's own Jinja template
  (its CHAT_FORMAT, trim_blocks and lstrip_blocks on, its default system message where the
  conversation has none), as stock renders them. Stock writes each image's URL where the template
  puts it, then swaps the URL for libmtmd's media marker; the messages here carry the marker
  already (a content string, the marker where the client put the image: server/wire/media_parts.py),
  given back to these templates as stock gives them a message with images: a list of image_url
  parts (the marker their URL) and text parts, which the template orders as it does for stock.
"""
from __future__ import annotations

from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp import llama_chat_format

from ..engine.media import MEDIA_MARKER

# stock's chat_format values (llama_cpp/server/model.py) -> the handler class whose template renders them
_HANDLERS: dict[str, str] = {
    "llava-1-5": "Llava15ChatHandler",
    "obsidian": "ObsidianChatHandler",
    "llava-1-6": "Llava16ChatHandler",
    "moondream": "MoondreamChatHandler",
    "nanollava": "NanoLlavaChatHandler",
    "llama-3-vision-alpha": "Llama3VisionAlphaChatHandler",
    "minicpm-v-2.6": "MiniCPMv26ChatHandler",
    "qwen2.5-vl": "Qwen25VLChatHandler",
}
OWN_TEMPLATE = ("mtmd", "gemma4")  # MTMDChatHandler's: the GGUF's template
VISION_FORMATS = (*_HANDLERS, *OWN_TEMPLATE)


def needs_projector(chat_format: str | None) -> bool:
    """Whether stock serves `chat_format` only with a projector (it asserts clip_model_path)."""
    return chat_format in VISION_FORMATS


class VisionFormat:
    """A LLaVA-family handler's template as a chat formatter (the call llama_cpp's formatters
    answer: prompt, stop, added_special). `bos_token`: the BOS token's text where the model's
    tokenizer adds one (stock tokenizes these prompts with add_special), else empty."""

    def __init__(self, name: str, bos_token: str, eos_token: str) -> None:
        handler = getattr(llama_chat_format, _HANDLERS[name])
        self.name, self.bos_token, self.eos_token = name, bos_token, eos_token
        self.system: str | None = handler.DEFAULT_SYSTEM_MESSAGE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(handler.CHAT_FORMAT)

    def __call__(self, *, messages: list[dict[str, Any]], **_: Any) -> llama_chat_format.ChatFormatterResponse:
        """Tools and template switches are not in these templates: stock ignores them too."""
        if self.system is not None and not any(m.get("role") == "system" and m.get("content") for m in messages):
            messages = [{"role": "system", "content": self.system}, *messages]
        messages = [_as_parts(m) for m in messages]
        text = self._template.render(messages=messages, add_generation_prompt=True,
                                     eos_token=self.eos_token, bos_token=self.bos_token)
        return llama_chat_format.ChatFormatterResponse(prompt=self.bos_token + text, stop=None,
                                                       added_special=True)


def _as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A user message's content as the parts stock's handler templates take: every user message,
    with media or not, so the two render alike (given a string, llava-1-5's template writes its
    user turn twice, "USER: hiUSER: ", since a string is iterable in Jinja too)."""
    content = message.get("content")
    if message.get("role") != "user" or not isinstance(content, str):
        return message
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(content.split(MEDIA_MARKER)):
        if i:
            parts.append({"type": "image_url", "image_url": {"url": MEDIA_MARKER}})
        if text:
            parts.append({"type": "text", "text": text})
    return {**message, "content": parts}


def vision_format(name: str, bos_token: str, eos_token: str) -> VisionFormat | None:
    """The formatter of a LLaVA-family chat_format; None for any other name."""
    return VisionFormat(name, bos_token, eos_token) if name in _HANDLERS else None
