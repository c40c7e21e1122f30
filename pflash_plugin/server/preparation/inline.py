"""Which requests are prepared on the event loop itself rather than on a worker thread: a short
prompt with nothing to compile (no grammar, guided decoding, DRY, tools, logit bias, media, one
choice; a schema only once its constraint is kept, format_cache.py). Their preparation is a small template render and
tokenization, less than the hop it saves: a worker thread, then the loop again, each waited for
beside the long prompts' preparation (the GIL) and behind them in the pool. Beside mix8's 4 long
bodies on 2 CPU cores the hop took 7 ms (median) of a short request's way to the engine (issue 48)."""
from __future__ import annotations

from ..wire.peer_fields import asks_guide
from ..wire.protocol import ChatCompletionRequest, CompletionRequest
from .format_cache import FormatCache, format_key

INLINE_CHARS = 4096  # a prompt's characters (a chat's message texts together)
INLINE_IDS = 2048  # a prompt's token ids
INLINE_MESSAGES = 32


def inline(body: CompletionRequest | ChatCompletionRequest, prepared: FormatCache) -> bool:
    """Whether `body` is prepared on the event loop (its preparation is bounded and small): a
    JSON response_format only where `prepared` holds that schema (format_cache.py)."""
    if (body.n or 1) != 1 or body.grammar or body.logit_bias or body.dry_multiplier or asks_guide(body):
        return False
    if body.response_format is not None and body.response_format.type != "text" \
            and format_key(body.response_format) not in prepared:
        return False
    if isinstance(body, CompletionRequest):
        prompt = body.prompt
        if isinstance(prompt, str):
            return len(prompt) <= INLINE_CHARS
        return len(prompt) <= INLINE_IDS and all(isinstance(token, int) for token in prompt)
    if body.tools or body.functions or len(body.messages) > INLINE_MESSAGES:
        return False
    texts = [message.content for message in body.messages]
    return (all(text is None or isinstance(text, str) for text in texts)  # content parts may be media
            and sum(len(text or "") for text in texts) <= INLINE_CHARS)
