"""A loaded GGUF model: weights, vocabulary, tokenizer, metadata."""
from __future__ import annotations

import ctypes
import os

import llama_cpp.llama_cpp as C

from .backend import init_backend
from .cpu_path import CpuPath, verdict


class Model:
    def __init__(
        self,
        path: str | os.PathLike,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        use_mlock: bool = False,
        vocab_only: bool = False,
        verbose: bool = False,
        use_extra_bufts: bool | None = None,
    ) -> None:
        """`use_extra_bufts` None: this process's CPU path decides (see cpu_path.py: AMX probe)."""
        init_backend(verbose)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model file not found: {path}")
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = use_mmap
        params.use_mlock = use_mlock
        params.vocab_only = vocab_only
        if use_extra_bufts is not None or vocab_only:  # a vocabulary computes nothing: no probe
            chosen = CpuPath(use_extra_bufts is not False, "set by the caller")
        else:
            chosen = verdict()
        params.use_extra_bufts = chosen.use_extra_bufts
        self.cpu_path = chosen.label  # reported on /status
        self.path = os.fspath(path)
        self.n_gpu_layers = n_gpu_layers  # layers asked on the GPU (0: none; the scorer follows them)
        self.ptr = C.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise ValueError(f"llama.cpp could not load the model {self.path}")
        self.vocab = C.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = C.llama_vocab_n_tokens(self.vocab)
        # a vocab-only load has no hyperparameters (llama.cpp aborts when asked for them)
        hparams = not vocab_only
        self.n_layer: int = C.llama_model_n_layer(self.ptr) if hparams else 0
        self.n_head: int = C.llama_model_n_head(self.ptr) if hparams else 0
        self.n_head_kv: int = C.llama_model_n_head_kv(self.ptr) if hparams else 0
        self.n_embd: int = C.llama_model_n_embd(self.ptr) if hparams else 0
        self.n_swa: int = C.llama_model_n_swa(self.ptr) if hparams else 0
        self.n_ctx_train: int = C.llama_model_n_ctx_train(self.ptr) if hparams else 0
        self.bos: int = C.llama_vocab_bos(self.vocab)
        self.eos: int = C.llama_vocab_eos(self.vocab)
        self.add_bos: bool = C.llama_vocab_get_add_bos(self.vocab)
        self.size_bytes: int = C.llama_model_size(self.ptr)
        self._pieces: dict[int, bytes] = {}

    def close(self) -> None:
        if self.ptr:
            C.llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()

    # ---- metadata --------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    def chat_template(self) -> str | None:
        raw = C.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8") if raw else None

    def kv_bytes_per_token(self) -> int:
        """f16 K and V of every layer: what one token costs in a full-size (swa_full) KV cache."""
        return self.n_layer * self.n_head_kv * self.head_dim() * 2 * 2

    def head_dim(self) -> int:
        key = self.meta(f"{self.architecture}.attention.key_length")
        return int(key) if key else self.n_embd // self.n_head

    # ---- tokenizer -------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token (cached: the vocabulary never changes)."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def token_text(self, token: int) -> str:
        return C.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    def check_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
