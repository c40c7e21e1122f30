"""A rendered prompt's media tokenized (issue 46): the text around the markers is tokenized as any
prompt's text is (runtime/prompts.py: a control token the client's text spells stays text), each
item by the engine's projector on its own (libmtmd: the item's chunk with the projector's wrapper
text around it, e.g. Gemma 3's <start_of_image>), which takes the item's positions as pseudo-token
ids (engine/media_prompt.py). libmtmd would tokenize the whole prompt with special tokens parsed;
item by item it gives the same tokens for the same text (tests/test_media_api.py checks them
against `engine.media.prompt`). What libmtmd cannot take is the client's 400."""
from __future__ import annotations

import time
from dataclasses import replace

from ...engine.media import MEDIA_MARKER
from ...engine.media_prompt import MediaSpan
from ...llama.media import MediaChunk, MediaError
from ..runtime.media_prepare import mark
from ..runtime.models import ServedModel
from ..runtime.prompts import ChatPrompt
from ..wire.protocol import RequestError


def media_tokens(served: ServedModel, rendered: ChatPrompt) -> ChatPrompt:
    """A prompt with media as the engine's tokens and spans; a prompt without media as it is."""
    if not rendered.media:
        return rendered
    encoder = served.engine.media
    if encoder is None:  # the reader refuses media first: a model without a projector gets none here
        raise RequestError(400, "this model has no multimodal projector (--mmproj)", param="messages")
    tokens: list[int] = list(rendered.pieces[0])
    spans: list[MediaSpan] = []
    start = time.perf_counter()
    try:
        for item, piece in zip(rendered.media, rendered.pieces[1:]):
            for chunk in encoder.projector.tokenize(MEDIA_MARKER, [(item.kind, item.data)]):
                if isinstance(chunk, MediaChunk):
                    spans.append(MediaSpan(len(tokens), chunk))
                    tokens += chunk.pseudo_tokens()
                else:
                    tokens += chunk.tokens
            tokens += piece
    except MediaError as error:
        raise RequestError(400, f"messages: {error}", param="messages") from None
    finally:
        mark("tokenize_s", time.perf_counter() - start)
    if tokens and tokens[-1] < 0:  # the row after the prompt's last token gives the first token's logits
        raise RequestError(400, "messages: the prompt ends with a media item: some text must follow it",
                           param="messages")
    return replace(rendered, tokens=tokens, spans=tuple(spans))
