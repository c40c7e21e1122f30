"""Media a request carries beside its prompt text (issue 46): the seam between the APIs that parse
images and audio and the engine that encodes them with libmtmd. The prompt text holds one
`MEDIA_MARKER` where each item goes, in order (libmtmd's default marker, as llama-server uses)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MEDIA_MARKER = "<__media__>"


@dataclass(frozen=True)
class MediaInput:
    """One image or audio clip as the client sent it: its bytes (decoded from base64 or fetched)
    and the MIME type its bytes were recognised as."""

    kind: Literal["image", "audio"]
    data: bytes
    mime: str
