"""A media item's bytes as a client sends them (issue 46): base64 (in a data URL or bare) decoded
only once its length is known to fit, the format recognised by its magic bytes (what libmtmd
decodes: PNG, JPEG, GIF, WebP, BMP images; WAV, MP3, FLAC audio), and an image's width and height
read from its header, so that an oversized image is refused before anything decodes its pixels.
Each refusal is a RequestError (400) naming the client's field."""
from __future__ import annotations

import base64
import binascii
import re
import struct
from dataclasses import dataclass

from .protocol import RequestError

# magic bytes -> (kind, MIME type); WebP and WAV share RIFF and are told apart by bytes 8-12
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image", "image/png"),
    (b"\xff\xd8\xff", "image", "image/jpeg"),
    (b"GIF87a", "image", "image/gif"),
    (b"GIF89a", "image", "image/gif"),
    (b"BM", "image", "image/bmp"),
    (b"fLaC", "audio", "audio/flac"),
    (b"ID3", "audio", "audio/mpeg"),
)
# MIME types clients send for the same formats
ALIASES = {"image/jpg": "image/jpeg", "image/x-ms-bmp": "image/bmp", "audio/wave": "audio/wav",
           "audio/x-wav": "audio/wav", "audio/vnd.wave": "audio/wav", "audio/mp3": "audio/mpeg",
           "audio/x-flac": "audio/flac"}
AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac"}  # chat's input_audio.format
_SPACES = " \n\r\t"
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[^;,]*)*)(;base64)?,", re.ASCII)


@dataclass(frozen=True)
class Sniffed:
    kind: str  # image | audio
    mime: str


def sniff(data: bytes) -> Sniffed | None:
    """The format the bytes are, by their magic; None for none that libmtmd takes."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return Sniffed("image", "image/webp")
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return Sniffed("audio", "audio/wav")
    for magic, kind, mime in _MAGIC:
        if data.startswith(magic):
            return Sniffed(kind, mime)
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0 and data[1] & 0x06:  # an MPEG audio frame
        return Sniffed("audio", "audio/mpeg")
    return None


def canonical(mime: str) -> str:
    mime = mime.strip().lower()
    return ALIASES.get(mime, mime)


def decoded_base64(text: str, field: str, max_bytes: int, start: int = 0) -> bytes:
    """The bytes of base64 `text[start:]`; refused before decoding (before copying) when they would
    be over `max_bytes` (the decoded length is known from the text's), or when it is not base64."""
    head = text[start:start + 128]  # MIME base64 breaks its lines every 76 characters; other spaces are invalid
    spaced = any(c in head for c in _SPACES)
    length = len(text) - start - (sum(text.count(c, start) for c in _SPACES) if spaced else 0)
    if length * 3 // 4 - 2 > max_bytes:  # at most 2 bytes of padding
        raise _too_big(field, length * 3 // 4, max_bytes)
    compact = "".join(text[start:].split()) if spaced else text[start:]
    size = len(compact) * 3 // 4 - compact[-2:].count("=")
    if size > max_bytes:
        raise _too_big(field, size, max_bytes)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{field}: not valid base64", param=field) from None
    if not data:
        raise RequestError(400, f"{field}: the media item is empty", param=field)
    return data


def _too_big(field: str, size: int, max_bytes: int) -> RequestError:
    return RequestError(400, f"{field}: {size:,} bytes, over the server's limit of {max_bytes:,} per media item "
                        "(--media_max_bytes)", param=field)


def data_url(url: str, field: str, max_bytes: int) -> tuple[str | None, bytes]:
    """A `data:` URL's MIME type (None when it names none) and bytes; only base64 data URLs are taken."""
    match = _DATA_URL.match(url)
    if match is None:
        raise RequestError(400, f"{field}: a data URL is data:<type>;base64,<data>", param=field)
    if not match.group(3):
        raise RequestError(400, f"{field}: the data URL must be base64 encoded (data:<type>;base64,...)",
                           param=field)
    mime = canonical(match.group(1)) if match.group(1) else None
    return mime, decoded_base64(url, field, max_bytes, start=match.end())


def image_size(data: bytes, mime: str) -> tuple[int, int] | None:
    """(width, height) from the image's header without decoding it; None where the header is
    cut short or malformed (the image is then corrupt)."""
    try:
        if mime == "image/png":
            return _png(data)
        if mime == "image/gif":
            return struct.unpack("<HH", data[6:10]) if len(data) >= 10 else None
        if mime == "image/bmp":
            width, height = struct.unpack("<ii", data[18:26])
            return width, abs(height)
        if mime == "image/webp":
            return _webp(data)
        if mime == "image/jpeg":
            return _jpeg(data)
    except struct.error:
        return None
    return None


def _png(data: bytes) -> tuple[int, int] | None:
    if data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20:21] == b"\x2f":
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes) -> tuple[int, int] | None:
    """The frame header's size: the segments walked by their lengths up to the first SOF marker."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            at += 2
            continue
        length = struct.unpack(">H", data[at + 2:at + 4])[0]
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return width, height
        if length < 2:
            return None
        at += 2 + length
    return None
