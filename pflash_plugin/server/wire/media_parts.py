"""Media parts as each API spells them (issue 46), read into one `MediaSource`: chat's `image_url`
(a string or {url, detail}) and `input_audio` ({data, format}), Responses' `input_image`
(image_url or file_id) and `input_audio`, Messages' `image` blocks (source base64 with
media_type, or url). A source names the client's own field, so every later refusal (its bytes,
its size, its host) says where the item was. Nothing is decoded or fetched here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict

from .media_bytes import AUDIO_FORMATS, canonical
from .protocol import ContentPart, RequestError

MediaKind = Literal["image", "audio"]
CHAT_MEDIA = ("image_url", "input_audio")  # chat's media part types


@dataclass(frozen=True)
class MediaSource:
    """One media item as the client sent it: an http(s) or data URL, or bare base64 `data`."""

    kind: MediaKind
    where: str  # the client's field that holds the URL or data
    url: str | None = None
    data: str | None = None
    mime: str | None = None  # the type the client declared (media_type, format)


class MediaPart(ContentPart):
    """A media part another API's body was translated into (Responses, Messages): its source as
    read from that API's fields. Only the translation makes one; a chat client's JSON cannot."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)
    source: MediaSource


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(400, f"{where}: a non-empty string is required", param=where)
    return value


def url_source(kind: MediaKind, url: Any, where: str) -> MediaSource:
    """An http(s) URL, a data URL, or (as llama.cpp takes it) bare base64."""
    url = _string(url, where)
    if url.startswith(("http://", "https://", "data:")):
        return MediaSource(kind, where, url=url)
    if "://" in url[:16]:
        raise RequestError(400, f"{where}: an http(s) URL, a data URL or base64 data ({url.split(':')[0]}: URLs are "
                           "not fetched)", param=where)
    return MediaSource(kind, where, data=url)


def audio_source(audio: Any, where: str) -> MediaSource:
    """OpenAI's input_audio: {data: base64, format: wav | mp3} (flac too: libmtmd decodes it)."""
    if not isinstance(audio, dict):
        raise RequestError(400, f"{where}: an object with data (base64) and format", param=where)
    fmt = audio.get("format")
    if fmt not in AUDIO_FORMATS:
        raise RequestError(400, f"{where}.format: one of {', '.join(AUDIO_FORMATS)}", param=f"{where}.format")
    return MediaSource("audio", f"{where}.data", data=_string(audio.get("data"), f"{where}.data"),
                       mime=AUDIO_FORMATS[fmt])


def chat_source(part: ContentPart, where: str) -> MediaSource:
    """Chat's image_url (a string, or {url, detail}) or input_audio part."""
    extra = part.model_extra or {}
    if part.type == "input_audio":
        return audio_source(extra.get("input_audio"), f"{where}.input_audio")
    image = extra.get("image_url")
    if isinstance(image, dict):
        return url_source("image", image.get("url"), f"{where}.image_url.url")
    return url_source("image", image, f"{where}.image_url")


def responses_source(part: dict[str, Any], where: str) -> MediaSource:
    """Responses' input_image ({image_url} or {file_id}) or input_audio ({input_audio: {data, format}})."""
    if part.get("type") == "input_audio":
        return audio_source(part.get("input_audio"), f"{where}.input_audio")
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise RequestError(400, f"{where}.file_id: this server keeps no files: send the image in image_url (a "
                           "data URL)", param=f"{where}.file_id")
    return url_source("image", part.get("image_url"), f"{where}.image_url")


def anthropic_source(source: Any, where: str) -> MediaSource:
    """Messages' image block source: {type: base64, media_type, data} or {type: url, url}."""
    where = f"{where}.source"
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        mime = _string(source.get("media_type"), f"{where}.media_type")
        return MediaSource("image", f"{where}.data", data=_string(source.get("data"), f"{where}.data"),
                           mime=canonical(mime))
    if kind == "url":
        url = _string(source.get("url"), f"{where}.url")
        if not url.startswith(("http://", "https://")):
            raise RequestError(400, f"{where}.url: an http(s) URL", param=f"{where}.url")
        return MediaSource("image", f"{where}.url", url=url)
    if kind == "file":
        raise RequestError(400, f"{where}.type: this server keeps no files: send the image as base64",
                           param=f"{where}.type")
    raise RequestError(400, f"{where}.type: base64 or url", param=f"{where}.type")


def joined(pieces: list[str | None], marker: str) -> str:
    """Text parts joined by newlines, a media part (None) as `marker` with no newline before or
    after it: llama.cpp's rule (common/chat.cpp, concat_content_parts), so the same parts always
    render the same text."""
    text, after_marker = "", False
    for piece in pieces:
        if piece is None:
            text, after_marker = text + marker, True
            continue
        text += ("\n" if text and not after_marker else "") + piece
        after_marker = False
    return text
