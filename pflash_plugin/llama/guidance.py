"""llguidance's view of a model's vocabulary: its tokenizer, built from the llama.cpp vocab.

llguidance (the constraint engine of engine/constraints.py) needs every token's bytes and a tokenize function
whose tokens spell exactly the bytes it was given: it tokenizes the text a grammar forces and allows only the
first of those tokens (so control tokens are parsed: a forced "[THINK]" or "<|channel|>" is the model's own
token, as llama-server's preserved tokens). llama.cpp's own tokenizer does not always spell its input back (a
SentencePiece vocabulary reads "▁" as a space: a grammar that forces "▁" got a token for " ", which the parser
then refused), so here a tokenization that does not spell its input is replaced by a greedy longest-match one
that does. Building it reads the whole vocabulary once (262K tokens: about 2 s on one core), so each model's
is built on first use and kept.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import llama_cpp.llama_cpp as C
import llguidance

from .model import Model

_TOKENIZERS: weakref.WeakKeyDictionary[Model, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _VocabTokenizer:
    """What llguidance.TokenizerWrapper reads: the tokens' bytes, the special ids, and `__call__`.
    Only the end-of-generation tokens are special (their bytes marked with a 0xFF prefix): a grammar
    ends with one of them. Other control tokens spell their text, as in llama.cpp's grammar sampler,
    so a forced tool call's "<|channel|>" or "<tool_call>" may be the model's own token for it
    (llguidance's llama.cpp bridge marks them all: the literal then had to be spelled out in
    pieces, which a real model rarely writes)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        buffer = ctypes.create_string_buffer(1024)
        self.pieces = [_piece(model, token, buffer) for token in range(model.n_vocab)]
        special = [token for token in range(model.n_vocab) if model.is_eog(token)]
        self.special_token_ids = special
        self.tokens = list(self.pieces)
        for token in special:
            self.tokens[token] = b"\xff" + self.pieces[token]
        self.eos_token_id = model.eos
        self.bos_token_id = model.bos if model.bos >= 0 else None
        plain = set(range(model.n_vocab)) - set(special)
        self._by_bytes = {self.pieces[t]: t for t in sorted(plain, reverse=True) if self.pieces[t]}
        self._longest = max((len(piece) for piece in self._by_bytes), default=1)

    def __call__(self, data: bytes) -> list[int]:
        tokens = self.model.tokenize(data, add_special=False, parse_special=True)
        if b"".join(self.tokens[t] for t in tokens) == data:
            return tokens
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        """The longest token at each position (a byte no token spells is skipped: a vocabulary
        without byte tokens cannot write it at all)."""
        tokens, at = [], 0
        while at < len(data):
            for length in range(min(self._longest, len(data) - at), 0, -1):
                token = self._by_bytes.get(data[at:at + length])
                if token is not None:
                    tokens.append(token)
                    at += length
                    break
            else:
                at += 1
        return tokens


def _piece(model: Model, token: int, buffer: ctypes.Array[ctypes.c_char]) -> bytes:
    n = C.llama_token_to_piece(model.vocab, token, buffer, len(buffer), 0, True)
    if n > len(buffer):
        buffer = ctypes.create_string_buffer(n)
        n = C.llama_token_to_piece(model.vocab, token, buffer, len(buffer), 0, True)
    return buffer.raw[:max(n, 0)]


def guidance_tokenizer(model: Model) -> llguidance.LLTokenizer:
    """The model's llguidance tokenizer, every end-of-generation token its end of a grammar."""
    with _LOCK:
        tokenizer = _TOKENIZERS.get(model)
        if tokenizer is None:
            vocab = _VocabTokenizer(model)
            wrapper = llguidance.TokenizerWrapper(vocab)
            tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=model.n_vocab,
                                               eos_token=vocab.special_token_ids or [model.eos])
            _TOKENIZERS[model] = tokenizer
        return tokenizer
