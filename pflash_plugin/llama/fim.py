"""A vocabulary's fill-in-the-middle tokens, as llama.cpp reads them: the GGUF's
tokenizer.ggml.fim_*_token_id keys, else the tokens it recognises by their text (Qwen's
<|fim_prefix|>, CodeLlama's <PRE>, DeepSeek's <｜fim▁begin｜>, ...). Code editors' completion
(llama-server's /infill, /v1/completions with a suffix) builds its prompt from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import llama_cpp.llama_cpp as C


@dataclass(frozen=True)
class FimTokens:
    """Each FIM token's id, None where the vocabulary has none."""

    pre: int | None  # before the code ahead of the cursor
    suf: int | None  # before the code after the cursor
    mid: int | None  # where the model writes what goes in between
    pad: int | None
    rep: int | None  # a repository's name (repo-level context)
    sep: int | None  # a file of the repo-level context

    def missing(self) -> list[str]:
        """The names of the three tokens a FIM prompt needs that the vocabulary lacks."""
        return [name for name, token in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
                if token is None]


def _token(read: Callable[[Any], int], vocab: Any) -> int | None:
    token = read(vocab)
    return None if token == C.LLAMA_TOKEN_NULL else int(token)


def fim_tokens(vocab: Any) -> FimTokens:
    """The FIM tokens of a loaded vocabulary (llama_vocab *)."""
    return FimTokens(*(_token(read, vocab) for read in (
        C.llama_vocab_fim_pre, C.llama_vocab_fim_suf, C.llama_vocab_fim_mid,
        C.llama_vocab_fim_pad, C.llama_vocab_fim_rep, C.llama_vocab_fim_sep)))
