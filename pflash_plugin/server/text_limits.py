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

from ..llama import Model
from .protocol import RequestError


class TextLimit:
    def __init__(self, model: Model, max_tokens: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._piece: int | None = None
        self._lock = threading.Lock()

    def check_text(self, text: str, param: str) -> None:
        """A 400 for a text whose tokens cannot fit in max_ctx, before it is tokenized."""
        if len(text) <= self.max_tokens:  # every token holds at least one character
            return
        most = self.max_tokens * self.longest_piece()
        if len(text) > most:
            raise RequestError(400, f"{param}: {len(text):,} characters are over max_ctx ({self.max_tokens:,} "
                               f"tokens) whatever they are: a token of this model holds at most "
                               f"{self.longest_piece()} characters, so {most:,} characters at most", param=param)

    def check_tokens(self, tokens: list[int], param: str) -> None:
        if len(tokens) > self.max_tokens:
            raise RequestError(400, f"{param}: {len(tokens):,} tokens are over max_ctx ({self.max_tokens:,})",
                               param=param)

    def longest_piece(self) -> int:
        with self._lock:
            if self._piece is None:
                self._piece = self.model.longest_piece()
            return self._piece
