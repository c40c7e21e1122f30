"""A request's media sources read into the engine's MediaInput (issue 46), each limit before the
work it bounds (issue 49's rule): the projector and the count first, then per item the bytes
(base64 length before decoding it, a fetch's length as it arrives), the format by its magic bytes
against the kind and the MIME type the client declared, and an image's pixels from its header,
before libmtmd decodes anything. Every refusal is a 400 naming the client's field."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from ...engine.media import MediaInput
from ...engine.media_encoder import MediaEncoder
from ..config.settings import ModelSettings
from ..operations.media_fetch import FetchLimits, Fetched, fetch
from ..wire.media_bytes import canonical, data_url, decoded_base64, image_size, sniff
from ..wire.media_parts import MediaSource
from ..wire.protocol import RequestError
from .media_prepare import mark

FORMATS = "PNG, JPEG, GIF or BMP images; WAV, MP3 or FLAC audio"
# recognised, but libmtmd's decoder (stb_image) has none for them: refused before it fails on them
UNDECODED = {"image/webp": "libmtmd decodes no WebP images: send PNG or JPEG"}
_GENERIC = ("application/octet-stream", "binary/octet-stream")  # a fetched body's type that says nothing


@dataclass(frozen=True)
class MediaLimits:
    max_items: int
    max_pixels: int
    fetch: FetchLimits  # its max_bytes bounds every item, however sent

    @classmethod
    def of(cls, s: ModelSettings) -> MediaLimits:
        return cls(s.media_max_items, s.media_max_pixels,
                   FetchLimits(frozenset(s.media_hosts), s.media_max_bytes, s.media_fetch_timeout_s))


def media_kinds(encoder: MediaEncoder | None) -> frozenset[str]:
    """What the model's projector takes: image, audio, both, or nothing (no projector)."""
    if encoder is None:
        return frozenset()
    projector = encoder.projector
    return frozenset(kind for kind, takes in (("image", projector.vision), ("audio", projector.audio)) if takes)


def _refuse(where: str, why: str) -> RequestError:
    return RequestError(400, f"{where}: {why}", param=where)


class MediaReader:
    """One model's reading of media: `kinds` what its projector takes (empty: it has none)."""

    def __init__(self, limits: MediaLimits, kinds: frozenset[str]) -> None:
        self.limits, self.kinds = limits, kinds

    def read(self, sources: Sequence[MediaSource]) -> tuple[MediaInput, ...]:
        if not sources:
            return ()
        start = time.perf_counter()
        try:
            return self._read(sources)
        finally:
            mark("media_s", time.perf_counter() - start)

    def _read(self, sources: Sequence[MediaSource]) -> tuple[MediaInput, ...]:
        if not self.kinds:
            first = sources[0]
            raise _refuse(first.where, f"this model has no multimodal projector, so it takes no {first.kind}: "
                          "serve it with --mmproj (stock's clip_model_path) and its projector GGUF")
        if len(sources) > self.limits.max_items:
            raise _refuse(sources[self.limits.max_items].where, f"{len(sources)} media items, over the server's "
                          f"limit of {self.limits.max_items} per request (--media_max_items)")
        for source in sources:
            if source.kind not in self.kinds:
                raise _refuse(source.where, f"this model's projector takes no {source.kind} (it takes "
                              f"{' and '.join(sorted(self.kinds))})")
        remote = [(i, s.url, s.where) for i, s in enumerate(sources) if s.url and not s.url.startswith("data:")]
        if len(remote) < 2:
            return tuple(self.item(source) for source in sources)
        # the URLs at once, each within the fetch limits (16 slow hosts one after another took 16x
        # the timeout); the items checked in order, so the first bad one is still the one refused
        pool = ThreadPoolExecutor(len(remote), thread_name_prefix="pflash-media-fetch")
        try:
            fetches = {i: pool.submit(fetch, url, self.limits.fetch, where) for i, url, where in remote}
            return tuple(self.item(source, fetches.get(i)) for i, source in enumerate(sources))
        finally:  # after a refusal: fetches not begun never begin, those under way end by their deadline
            pool.shutdown(wait=False, cancel_futures=True)

    def item(self, source: MediaSource, fetched_future: Future[Fetched] | None = None) -> MediaInput:
        where, max_bytes = source.where, self.limits.fetch.max_bytes
        declared = source.mime
        if source.url is not None and source.url.startswith("data:"):
            declared, data = data_url(source.url, where, max_bytes)
        elif source.url is not None:
            fetched = fetched_future.result() if fetched_future else fetch(source.url, self.limits.fetch, where)
            data, declared = fetched.data, fetched.mime if fetched.mime not in _GENERIC else None
        else:
            data = decoded_base64(source.data or "", where, max_bytes)
        sniffed = sniff(data)
        if sniffed is None:
            raise _refuse(where, f"the bytes are no format the projector decodes ({FORMATS})")
        if sniffed.kind != source.kind:
            wanted = "an image" if source.kind == "image" else "audio"
            raise _refuse(where, f"the bytes are {sniffed.mime}, where {wanted} is expected")
        if declared is not None and canonical(declared) != sniffed.mime:
            raise _refuse(where, f"declared as {declared}, but the bytes are {sniffed.mime}")
        if sniffed.mime in UNDECODED:
            raise _refuse(where, UNDECODED[sniffed.mime])
        if sniffed.kind == "image":
            self._check_pixels(data, sniffed.mime, where)
        return MediaInput(source.kind, data, sniffed.mime)

    def _check_pixels(self, data: bytes, mime: str, where: str) -> None:
        size = image_size(data, mime)
        if size is None or size[0] <= 0 or size[1] <= 0:
            raise _refuse(where, f"a corrupt {mime} image (its header gives no width and height)")
        width, height = size
        if width * height > self.limits.max_pixels:
            raise _refuse(where, f"{width}x{height} = {width * height:,} pixels, over the server's limit of "
                          f"{self.limits.max_pixels:,} (--media_max_pixels)")

