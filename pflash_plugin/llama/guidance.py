"""llguidance's view of a model's vocabulary: its tokenizer, built from the llama.cpp vocab.

llguidance (the constraint engine of engine/constraints.py) needs every token's bytes and a tokenize function
whose tokens spell exactly the bytes it was given: it tokenizes the text a grammar forces and allows only the
first of those tokens (so control tokens are parsed: a forced "[THINK]" or "<|channel|>" is the model's own
token, as llama-server's preserved tokens). llama.cpp's own tokenizer does not always spell its input back (a
SentencePiece vocabulary reads "▁" as a space: a grammar that forces "▁" got a token for " ", which the parser
then refused), so here a tokenization that does not spell its input is replaced by a greedy longest-match one
that does. Building it reads the whole vocabulary once (262K tokens: about 2 s on one core), so each model's
is built on first use and kept.

Its slices are fitted to the vocabulary (`string_slices`): llguidance precomputes the mask of each slice (a
JSON string's characters up to n long) and, where a string's lexer state takes every member of one, copies it
instead of walking those tokens through the token trie. Its defaults stop at 10 and 30 characters; a string
with 11-29 characters left (a `maxLength`) then walked every token of that band, which at the H200 benches'
128K vocabulary (127,000 tokens of 11-14 characters) cost ~1.8 ms a mask, and 64 rows' first masks inside a
string 265 ms on one core (17 ms fitted). The masks are the same either way.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import llama_cpp.llama_cpp as C
import llguidance

from .model import Model

# a JSON string's characters, as llguidance's own slices spell them (LLTokenizer.general_slices())
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
_WHITESPACE = r"[\x20\x0A\x0D\x09]+"
_BOUNDS = (10, 30)  # llguidance's own string slices' lengths
# a length between them gets a slice of its own where this share of the vocabulary has that many characters
_BAND_SHARE = 64

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
        special = list(model.eog_tokens)
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


def string_slices(pieces: list[bytes]) -> list[str]:
    """llguidance's slices for this vocabulary: its general ones (whitespace; a string's characters up
    to 10, up to 30, any number) plus one up to each length under 30 that at least 1/_BAND_SHARE of
    the tokens spell as string characters, so a bounded string's mask walks few tokens whatever
    its length left (llguidance's slicer takes them in order: shortest bound first)."""
    lengths: dict[int, int] = {}
    for piece in pieces:
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and len(text) < _BOUNDS[-1] and all(ch not in '"\\' and 0x1F < ord(ch) != 0x7F for ch in text):
            lengths[len(text)] = lengths.get(len(text), 0) + 1
    crowded = {n for n, count in lengths.items() if count * _BAND_SHARE >= len(pieces)}
    bounds = sorted(crowded | set(_BOUNDS))
    return [_WHITESPACE, *(f"{_STRING_CHAR}{{1,{n}}}" for n in bounds), f"{_STRING_CHAR}+"]


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
                                               eos_token=vocab.special_token_ids or [model.eos],
                                               slices=string_slices(vocab.pieces))
            _TOKENIZERS[model] = tokenizer
        return tokenizer
