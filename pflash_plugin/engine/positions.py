"""A slot's decode positions (issue 46, M-RoPE). A slot's token list is its KV cells, one entry a
cell; a token's position is its index except after an image at M-RoPE positions (Qwen2-VL to
Qwen3.5): its n_tokens cells take n_pos positions (all at t = the image's first, libmtmd's
mtmd_image_tokens_get_decoder_pos), so each later position is its index less the n_tokens - n_pos
of every such image before it, as llama-server's server_tokens.pos_next counts them.

Both functions here say that: `position` from a request's media spans (the steps' rows, every step),
`kv_position` from a token list alone (the prefix cache's KV operations, on lists whose requests
are gone), which can since an M-RoPE image's pseudo-ids mark the cells that take no position
(llama/media.py: SAME_POSITION). Without such an image both are the index."""
from __future__ import annotations

from typing import Protocol, Sequence

from ..llama.media import MROPE_IDS_BELOW, SAME_POSITION, MediaChunk


class Span(Protocol):
    """A media chunk's place in a request's tokens (media_prompt.MediaSpan)."""

    @property
    def chunk(self) -> MediaChunk: ...
    @property
    def end(self) -> int: ...


def position(spans: Sequence[Span], index: int) -> int:
    """The position of the cell at `index` of a request's tokens (its prompt: `spans` its media)
    where that is a text token or a media chunk's first cell."""
    return index - sum(s.chunk.n_tokens - s.chunk.n_pos for s in spans if s.end <= index)


def kv_position(tokens: Sequence[int], index: int) -> int:
    """The KV position where `tokens[index:]` starts (what llama_memory_seq_rm / seq_cp take for
    the cells from `index`), `index` never inside an M-RoPE image (`whole_media`)."""
    if not tokens or min(tokens) >= MROPE_IDS_BELOW:
        return index
    return index - list(tokens[:index]).count(SAME_POSITION)


def whole_media(tokens: Sequence[int], n: int) -> int:
    """`n` (a prefix of `tokens` reused) moved back to the start of an M-RoPE image it would end
    inside: the image's cells share one KV position, so a part of one cannot be kept or removed."""
    if 0 < n < len(tokens) and tokens[n] < MROPE_IDS_BELOW and tokens[n - 1] < MROPE_IDS_BELOW:
        while n > 0 and tokens[n - 1] < MROPE_IDS_BELOW:
            n -= 1
    return n
