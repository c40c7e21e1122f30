"""Chat messages as the chat templates take them: each content a string (text parts joined by
newlines, as llama.cpp's server joins them), each media part (issue 46) the media marker where
the client put it (llama.cpp's rule: no newline beside a marker) with its source beside the
messages, in order. Media in a system message are refused (llama.cpp renders media in user turns)."""
from __future__ import annotations

from typing import Any

from ...engine.media import MEDIA_MARKER
from .media_parts import CHAT_MEDIA, MediaPart, MediaSource, chat_source, joined
from .protocol import ContentPart, Message, RequestError


def message_text(content: str | list[ContentPart] | None, field: str,
                 media: list[MediaSource] | None = None) -> str | None:
    """The content as text; media parts become the marker, their sources appended to `media`
    (None: a system message's content, whose media parts are refused naming the field)."""
    if content is None or isinstance(content, str):
        return content
    pieces: list[str | None] = []
    for j, part in enumerate(content):
        where = f"{field}.{j}"
        if isinstance(part, MediaPart) or part.type in CHAT_MEDIA:
            source = part.source if isinstance(part, MediaPart) else chat_source(part, where)
            if media is None:
                raise RequestError(400, f"{source.where}: a system message takes text only (send the "
                                   f"{source.kind} in a user message)", param=source.where)
            media.append(source)
            pieces.append(None)
            continue
        if part.type != "text":
            raise RequestError(400, f"{where}: a content part of type {part.type!r} is not taken here: send "
                               "'text', 'image_url' or 'input_audio' parts", param=f"{where}.type")
        if part.text is None:
            raise RequestError(400, f"{where}: a part of type 'text' needs a string 'text'", param=f"{where}.text")
        pieces.append(part.text)
    return joined(pieces, MEDIA_MARKER)


def chat_messages(messages: list[Message]) -> tuple[list[dict[str, Any]], list[MediaSource]]:
    """Messages as the chat templates take them (the keys the client sent, content as text, a
    developer message as a system message) and their media parts' sources, in order."""
    rendered: list[dict[str, Any]] = []
    media: list[MediaSource] = []
    for i, message in enumerate(messages):
        fields = message.model_dump(exclude_unset=True)
        if fields["role"] == "developer":
            fields["role"] = "system"
        if "content" in fields:
            takes = None if fields["role"] == "system" else media
            fields["content"] = message_text(message.content, f"messages.{i}.content", takes)
        rendered.append(fields)
    return rendered, media
