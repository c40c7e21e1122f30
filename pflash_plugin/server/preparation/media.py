"""A rendered prompt's media tokenized by the engine's projector (issue 46): libmtmd cuts the
prompt at its media markers, each item becomes pseudo-token ids at the positions its embeddings
take (engine/media_prompt.py); what libmtmd cannot take is the client's 400."""
from __future__ import annotations

from dataclasses import replace

from ...llama.media import MediaError
from ..runtime.models import ServedModel
from ..runtime.prompts import ChatPrompt
from ..wire.protocol import RequestError


def media_tokens(served: ServedModel, rendered: ChatPrompt) -> ChatPrompt:
    """A prompt with media tokenized by the engine's projector (text tokens, and each item's
    pseudo-token ids where its embeddings go); a prompt without media as it is."""
    if not rendered.media:
        return rendered
    if served.engine.media is None:  # read() refuses media first: a model without a projector gets none here
        raise RequestError(400, "this model has no multimodal projector (--mmproj)", param="messages")
    try:
        prompt = served.engine.media.prompt(rendered.text, rendered.media)
    except MediaError as error:
        raise RequestError(400, f"messages: {error}", param="messages") from None
    return replace(rendered, tokens=prompt.tokens, spans=prompt.spans)
