"""A prompt with media as the engine runs it (issue 46): one token list where each media chunk
holds its cells (one an embedding) with pseudo-token ids (negative, derived from a hash of its
bytes: never a real token), plus the spans that say where each chunk sits and give its embeddings.

So the slot bookkeeping, admission (media tokens count), the prefix cache (a resent image has
the same ids, so its KV is reused like text) and the host tier need no change; the step composer
(steps.py) cuts prefill chunks at span edges and hands a span's rows as embeddings, and a row's
position is its index but after an image at M-RoPE positions (positions.py).

How the server builds one (server side of issue 46):

    prompt = engine.media.prompt(text_with_markers, media_inputs)   # MediaError -> 400
    request = Request(prompt.tokens, params, media=prompt.spans)

`text_with_markers` holds one MEDIA_MARKER (engine/media.py) per MediaInput, in order, as the
chat template rendered it (special tokens are parsed, none added). PFlash never drops a media
chunk (pflash/media_text.py); `relocated` finds the kept chunks in the compressed prompt."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..llama.media import MediaChunk, MediaError, Projector, TextChunk
from .media import MediaInput
from .positions import position


@dataclass(eq=False)
class MediaSpan:
    """A media chunk at prompt tokens [start, start + n_tokens), a cell each (its positions: n_pos,
    fewer for an M-RoPE image: engine/positions.py). `embeddings` is set by the encoder
    (MediaEncoder.want) when the request is submitted: a future of the chunk's [n_tokens, n_embd]
    rows."""

    start: int
    chunk: MediaChunk
    embeddings: Future[np.ndarray] | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.chunk.n_tokens

    @property
    def non_causal(self) -> bool:
        """Decoded whole in one call with causal attention off (Gemma 3's images)."""
        return self.chunk.non_causal


@dataclass(frozen=True)
class MediaPrompt:
    tokens: list[int]
    spans: tuple[MediaSpan, ...]

    @property
    def media_tokens(self) -> int:
        return sum(span.chunk.n_tokens for span in self.spans)


def build_prompt(projector: Projector, text: str, media: Sequence[MediaInput]) -> MediaPrompt:
    """`text` (a MEDIA_MARKER per item) and its media as the engine's tokens and spans.
    MediaError (the client's fault) for media libmtmd cannot take, or a prompt that ends with
    media (a template always writes text after it: the row that gives the first token's logits)."""
    tokens: list[int] = []
    spans: list[MediaSpan] = []
    chunks = projector.tokenize(text, [(item.kind, item.data) for item in media])
    for chunk in chunks:
        if isinstance(chunk, TextChunk):
            tokens += chunk.tokens
        else:
            spans.append(MediaSpan(len(tokens), chunk))
            tokens += chunk.pseudo_tokens()
    if chunks and not isinstance(chunks[-1], TextChunk):
        raise MediaError("the prompt ends with a media item: some text must follow it")
    return MediaPrompt(tokens, tuple(spans))


def span_at(spans: Sequence[MediaSpan], index: int) -> MediaSpan | None:
    """The span holding prompt token `index`, if any."""
    return next((s for s in spans if s.start <= index < s.end), None)


def next_span_start(spans: Sequence[MediaSpan], index: int) -> int | None:
    """Where the first span after token `index` starts (None: only text follows)."""
    return next((s.start for s in spans if s.start > index), None)


@dataclass(frozen=True)
class MediaRows:
    """A step row's embeddings (a piece of a span) and their decoder positions ([n_sections, n]):
    decoded by a call of its own (runner.py)."""

    rows: np.ndarray
    positions: np.ndarray
    non_causal: bool


def prefill_piece(spans: Sequence[MediaSpan], start: int, n: int) -> tuple[int, MediaRows | None] | None:
    """How many of the `n` prefill tokens planned from prompt token `start` one row takes, cut at
    span edges (llama.cpp cannot mix embeddings and tokens in one decode), and the embeddings
    where they are a span's; a non-causal span is taken whole. None: the span's embeddings are
    not ready (still encoding, or failed: `failed_media`), so the request sits this step out."""
    span = span_at(spans, start) if spans else None
    if span is None:
        following = next_span_start(spans, start) if spans else None
        return (n if following is None else min(n, following - start)), None
    future = span.embeddings
    if future is None or not future.done() or future.exception() is not None:
        return None
    n = span.end - start if span.non_causal else min(n, span.end - start)
    offset = start - span.start
    positions = span.chunk.positions(position(spans, span.start), offset, n)
    return n, MediaRows(future.result()[offset : offset + n], positions, span.non_causal)


def piece_left(spans: Sequence[MediaSpan], start: int) -> int:
    """Prompt tokens from `start` to the next media edge (a span's start or end), where a step's
    chunk must end; 0 where only text follows (the step policy's Seat.piece_left)."""
    if not spans:
        return 0
    span = span_at(spans, start)
    if span is not None:
        return span.end - start
    following = next_span_start(spans, start)
    return 0 if following is None else following - start


def mrope_partial(spans: Sequence[MediaSpan], index: int) -> MediaSpan | None:
    """The M-RoPE image that a prefill standing at prompt token `index` is inside of, past its
    first cell (its cells share one KV position, so a failed step's cells of it cannot be told
    from the earlier steps': Steps.rollback takes the prefill back to its start)."""
    span = span_at(spans, index) if spans else None
    return span if span is not None and span.chunk.mrope_image and span.start < index else None


def media_failure(spans: Sequence[MediaSpan], start: int) -> BaseException | None:
    """Why the span at prompt token `start` (where a request's prefill stands) has no embeddings."""
    span = span_at(spans, start) if spans else None
    future = span.embeddings if span is not None else None
    return future.exception() if future is not None and future.done() else None


def relocated(spans: Sequence[MediaSpan], tokens: Sequence[int]) -> tuple[MediaSpan, ...]:
    """The spans at their places in `tokens`, a prompt PFlash compressed (pflash/media_text.py:
    each media run kept whole, at a new index; prefilled at contiguous positions like the text)."""
    out: list[MediaSpan] = []
    listed, at = list(tokens), 0
    for span in spans:
        start = listed.index(span.chunk.pseudo_tokens()[0], at)  # ValueError: the run was dropped
        out.append(MediaSpan(start, span.chunk, span.embeddings))
        at = start + span.chunk.n_tokens
    return tuple(out)
