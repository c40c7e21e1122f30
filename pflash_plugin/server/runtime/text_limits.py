"""How long a text may be before it is tokenized, and a token list after, for one model: max_ctx
tokens, the limit of every request.

Tokenizing is the one step before admission whose cost grows with the body: llama.cpp holds a few
dozen bytes per character while it tokenizes, and the tokens then become Python ints (a 7 MB body on
/extras/tokenize peaked at 848 MB, issue 31, where the completion routes would have refused the
prompt once tokenized). A token stands for at most `Model.longest_piece()` characters, so a text
longer than max_ctx times that is over max_ctx tokens whatever they are: refused before llama.cpp
sees it. The longest piece is read once, on the first text that needs it.
"""
from __future__ import annotations

import threading
from typing import Any

from ...engine.request import ErrorKind
from ...llama import Model
from ..wire.errors import http_of
from ..wire.protocol import RequestError


def _too_long(message: str, param: str) -> RequestError:
    """Over max_ctx: the 400 the engine's admission gives a prompt too long (OpenAI's
    invalid_request_error, code context_length_exceeded), found before the prompt is tokenized."""
    status, kind, code = http_of(ErrorKind.TOO_LONG)
    return RequestError(status, message, kind, param, code)


class TextLimit:
    def __init__(self, model: Model, max_tokens: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._piece: int | None = None
        self._lock = threading.Lock()

    def check_text(self, text: str, param: str, max_tokens: int | None = None) -> None:
        """A 400 for a text whose tokens cannot fit in `max_tokens` (max_ctx unless given), before
        it is tokenized."""
        self._check_chars(len(text), param, self.max_tokens if max_tokens is None else max_tokens)

    def check_messages(self, messages: list[dict[str, Any]], param: str = "messages") -> None:
        """A 400 for a conversation whose messages' text alone cannot fit in max_ctx, before the
        template renders it: a template writes every message's content and every call's arguments,
        so the prompt is at least that long (200K tool results of 8 MB rendered and joined for
        91 s before the prompt's length was checked, issue 49)."""
        total = 0
        for message in messages:
            content = message.get("content")
            total += len(content) if isinstance(content, str) else 0
            for call in message.get("tool_calls") or ():
                arguments = call.get("function", {}).get("arguments") if isinstance(call, dict) else None
                total += len(arguments) if isinstance(arguments, str) else 0
        self._check_chars(total, param, self.max_tokens)

    def check_turns(self, count: int, what: str, param: str) -> None:
        """A 400 for more messages (or tool calls and results) than max_ctx tokens: a template
        writes each one in at least a token of its own (a role marker, a result's tags)."""
        if count > self.max_tokens:
            raise _too_long(f"{param}: {count:,} {what} are over max_ctx ({self.max_tokens:,} tokens): each "
                            "one takes at least a token of the prompt", param)

    def _check_chars(self, chars: int, param: str, max_tokens: int) -> None:
        if chars <= max_tokens:  # every token holds at least one character
            return
        most = max_tokens * self.longest_piece()
        if chars > most:
            message = (f"{param}: {chars:,} characters are over {self._limit(max_tokens)} whatever they are: a "
                       f"token of this model holds at most {self.longest_piece()} characters, so {most:,} "
                       "characters at most")
            if max_tokens == self.max_tokens:
                raise _too_long(message, param)
            raise RequestError(400, message, param=param)  # another field's own limit (pflash.query)

    def _limit(self, max_tokens: int) -> str:
        return f"max_ctx ({max_tokens:,} tokens)" if max_tokens == self.max_tokens else f"{max_tokens:,} tokens"

    def check_tokens(self, tokens: list[int], param: str) -> None:
        if len(tokens) > self.max_tokens:
            raise _too_long(f"{param}: {len(tokens):,} tokens are over max_ctx ({self.max_tokens:,})", param)

    def longest_piece(self) -> int:
        with self._lock:
            if self._piece is None:
                self._piece = self.model.longest_piece()
            return self._piece
