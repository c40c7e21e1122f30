"""A loaded GGUF model: weights, vocabulary, tokenizer, metadata."""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import llama_cpp.llama_cpp as C

from .backend import init_backend
from .cpu_path import CpuPath, verdict
from .devices import gpu_count
from .fim import FimTokens, fim_tokens
from .held import holding_gil


_INT32_MAX = 0x7FFFFFFF  # n_gpu_layers -1: every layer (llama_cpp.Llama's mapping)
# a text up to this is tokenized holding the GIL (held.py): an image chat's pieces around the image, a
# short message (1 KB: 0.35 ms on Gemma 3's 262K vocabulary, 2 CPU cores); a longer one releases it
HELD_TOKENIZE_BYTES = 1024
_tokenize_held = holding_gil(C.llama_tokenize)
# a lookup of microseconds, once per generating row per step on the engine thread: releasing the GIL
# for it waits to take it back wherever the event loop streams answers (32 of the 35 GIL-releasing
# calls of a 32-row decode step; bench/vision_steps.py --calls)
_is_eog_held = holding_gil(C.llama_vocab_is_eog)
_piece_held = holding_gil(C.llama_token_to_piece)  # a token's text the first time it is seen: microseconds
KvOverride = tuple[str, "bool | int | float | str"]


@dataclass(frozen=True)
class RopeParams:
    """RoPE/YaRN overrides (llama_context_params) for every context of one model, so that the
    engine, the embedder and a drafter stopped early position tokens alike. The defaults are
    llama.cpp's: "as the model says"."""

    scaling_type: int = C.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED
    freq_base: float = 0.0
    freq_scale: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_orig_ctx: int = 0

    def apply(self, params: C.llama_context_params) -> None:
        params.rope_scaling_type = self.scaling_type
        params.rope_freq_base, params.rope_freq_scale = self.freq_base, self.freq_scale
        params.yarn_ext_factor, params.yarn_attn_factor = self.yarn_ext_factor, self.yarn_attn_factor
        params.yarn_beta_fast, params.yarn_beta_slow = self.yarn_beta_fast, self.yarn_beta_slow
        params.yarn_orig_ctx = self.yarn_orig_ctx


@dataclass(frozen=True)
class ModelParams:
    """How one GGUF loads (llama_model_params) and what every context of it gets (rope, LoRA)."""

    n_gpu_layers: int = 0  # -1: all
    split_mode: int = C.LLAMA_SPLIT_MODE_LAYER
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    kv_overrides: tuple[KvOverride, ...] = ()
    use_mmap: bool = True
    use_mlock: bool = False
    vocab_only: bool = False
    loras: tuple[tuple[str, float], ...] = ()  # (adapter GGUF, scale)
    rope: RopeParams = field(default_factory=RopeParams)


def _load_mode(use_mmap: bool, use_mlock: bool) -> int:
    """llama_cpp.Llama's mapping of use_mmap/use_mlock onto llama.cpp's load mode."""
    if use_mmap:
        return C.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mlock else C.LLAMA_LOAD_MODE_MMAP
    return C.LLAMA_LOAD_MODE_MLOCK if use_mlock else C.LLAMA_LOAD_MODE_NONE


def _kv_override_array(overrides: tuple[KvOverride, ...]) -> ctypes.Array:
    """llama_model_kv_override entries, ended by an empty key (llama.cpp's sentinel)."""
    array = (C.llama_model_kv_override * (len(overrides) + 1))()
    for entry, (key, value) in zip(array, overrides):
        entry.key = key.encode()
        if isinstance(value, bool):
            entry.tag, entry.value.val_bool = C.LLAMA_KV_OVERRIDE_TYPE_BOOL, value
        elif isinstance(value, int):
            entry.tag, entry.value.val_i64 = C.LLAMA_KV_OVERRIDE_TYPE_INT, value
        elif isinstance(value, float):
            entry.tag, entry.value.val_f64 = C.LLAMA_KV_OVERRIDE_TYPE_FLOAT, value
        else:
            entry.tag, entry.value.val_str = C.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
    return array


class Model:
    def __init__(
        self,
        path: str | os.PathLike,
        params: ModelParams = ModelParams(),
        *,
        verbose: bool = False,
        use_extra_bufts: bool | None = None,
        **fields: Any,
    ) -> None:
        """`fields` replace those of `params` (`Model(path, n_gpu_layers=99)`).
        `use_extra_bufts` None: this process's CPU path decides (see cpu_path.py: AMX probe)."""
        init_backend(verbose)
        self.ptr: Any = None
        self.loras: list[tuple[Any, float]] = []  # (llama_adapter_lora *, scale)
        self.params = params = replace(params, **fields)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model file not found: {path}")
        for lora, _ in params.loras:
            if not os.path.exists(lora):
                raise FileNotFoundError(f"LoRA adapter not found: {lora}")
        if use_extra_bufts is not None or params.vocab_only:  # a vocabulary computes nothing: no probe
            chosen = CpuPath(use_extra_bufts is not False, "set by the caller")
        else:
            chosen = verdict()
        self.cpu_path = chosen.label  # reported on /status
        self.path = os.fspath(path)
        self.n_gpu_layers = params.n_gpu_layers  # layers asked on the GPU (0: none; the scorer follows them)
        self.ptr = self._load(chosen.use_extra_bufts)
        self._load_loras()
        self.vocab = C.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = C.llama_vocab_n_tokens(self.vocab)
        # a vocab-only load has no hyperparameters (llama.cpp aborts when asked for them)
        hparams = not params.vocab_only
        self.n_layer: int = C.llama_model_n_layer(self.ptr) if hparams else 0
        self.n_head: int = C.llama_model_n_head(self.ptr) if hparams else 0
        self.n_head_kv: int = C.llama_model_n_head_kv(self.ptr) if hparams else 0
        self.n_embd: int = C.llama_model_n_embd(self.ptr) if hparams else 0
        self.n_swa: int = C.llama_model_n_swa(self.ptr) if hparams else 0
        self.n_ctx_train: int = C.llama_model_n_ctx_train(self.ptr) if hparams else 0
        self.bos: int = C.llama_vocab_bos(self.vocab)
        self.eos: int = C.llama_vocab_eos(self.vocab)
        self.add_bos: bool = C.llama_vocab_get_add_bos(self.vocab)
        self.fim: FimTokens = fim_tokens(self.vocab)  # fill-in-the-middle (code editors' completion)
        self.size_bytes: int = C.llama_model_size(self.ptr)
        self._pieces: dict[int, bytes] = {}
        self._rendered: set[int] = set()  # control tokens whose text `piece` writes (render_tokens)

    def _load(self, use_extra_bufts: bool) -> Any:
        p = self.params
        params = C.llama_model_default_params()
        params.n_gpu_layers = _INT32_MAX if p.n_gpu_layers == -1 else p.n_gpu_layers
        params.split_mode, params.main_gpu = p.split_mode, p.main_gpu
        params.load_mode = _load_mode(p.use_mmap, p.use_mlock)
        params.vocab_only = p.vocab_only
        params.use_extra_bufts = use_extra_bufts
        # both arrays only need to live through the load (llama.cpp copies what it keeps)
        split = (ctypes.c_float * C.LLAMA_MAX_DEVICES)(*p.tensor_split) if p.tensor_split else None
        if split is not None:
            params.tensor_split = split
        overrides = _kv_override_array(p.kv_overrides) if p.kv_overrides else None
        if overrides is not None:
            params.kv_overrides = overrides
        ptr = C.llama_model_load_from_file(self.path.encode(), params)
        if not ptr:
            raise ValueError(f"llama.cpp could not load the model {self.path}")
        return ptr

    def _load_loras(self) -> None:
        """The adapters, loaded once per model; every context of the model applies them."""
        for path, scale in self.params.loras:
            adapter = C.llama_adapter_lora_init(self.ptr, path.encode())
            if not adapter:
                self.close()
                raise ValueError(f"llama.cpp could not load the LoRA adapter {path} onto {self.path}")
            self.loras.append((adapter, scale))

    def close(self) -> None:
        """Free the weights (and with them the LoRA adapters: llama.cpp frees those with the model)."""
        self.loras = []
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

    @property
    def layers_on_gpu(self) -> bool:
        """Whether any layer is computed on a GPU (where CUDA loads kernels at first launch, and a
        step's prefill costs the decoding rows little)."""
        return gpu_count() > 0 and self.n_gpu_layers != 0

    @property
    def output_on_gpu(self) -> bool:
        """Whether the output layer (so the logits) is computed on a GPU: llama_decode then returns
        before its outputs are there, and reading them waits for the device. Elsewhere the decode
        has computed them when it returns."""
        return gpu_count() > 0 and (self.n_gpu_layers < 0 or self.n_gpu_layers > self.n_layer)

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
        call = _tokenize_held if len(data) <= HELD_TOKENIZE_BYTES else C.llama_tokenize
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = call(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = call(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token (cached: the vocabulary never changes); a control token's are empty
        unless `render_tokens` named it."""
        cached = self._pieces.get(token)
        if cached is None:
            if not 0 <= token < self.n_vocab:  # llama.cpp would abort the process (std::out_of_range)
                raise ValueError(f"token {token} is not in the vocabulary (0..{self.n_vocab - 1})")
            special = token in self._rendered
            buf = ctypes.create_string_buffer(64)
            n = _piece_held(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = _piece_held(self.vocab, token, buf, len(buf), 0, special)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's `piece`, a media pseudo-id's (negative) empty. Where every token was seen
        before, one dict lookup a token in C: 22K tokens in 0.8 ms against 2.1 ms for a `piece` call
        each on 2 CPU cores, Python that holds the GIL from the engine thread (a PFlash plan reads
        a prompt's every piece on its request thread)."""
        try:
            return list(map(self._pieces.__getitem__, tokens))
        except KeyError:  # a token not seen yet, or a media pseudo-id: one by one, caching the new ones
            return [self.piece(t) if t >= 0 else b"" for t in tokens]

    def render_tokens(self, texts: Iterable[str]) -> list[int]:
        """Have `piece` write these texts where each is one token, control tokens too: the markers a
        chat parser reads (llama-server's preserved_tokens), which the text would otherwise lose.
        Returns the tokens now written (a text of several tokens is written as text anyway)."""
        rendered = []
        for text in texts:
            tokens = self.tokenize(text, add_special=False, parse_special=True)
            if len(tokens) == 1:
                self._rendered.add(tokens[0])
                self._pieces.pop(tokens[0], None)
                rendered.append(tokens[0])
        return rendered

    def longest_piece(self) -> int:
        """The most characters one token stands for, special tokens' text included: a text of n
        characters is at least n / this many tokens (one pass over the vocabulary: 0.3-2 s for
        262K tokens, so callers ask once, and only for texts that need it)."""
        buf = ctypes.create_string_buffer(256)
        longest = 1
        for token in range(self.n_vocab):
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            if n < 0:  # longer than the buffer
                n = -n
                buf = ctypes.create_string_buffer(n)
                C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            longest = max(longest, len(buf.raw[:n].decode("utf-8", errors="replace")))
        return longest

    def token_text(self, token: int) -> str:
        """A token's text in the vocabulary, a control token's included (`piece` renders those as
        nothing): what chat templates get as bos_token and eos_token, as in llama_cpp.Llama."""
        return (C.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", errors="replace")

    def control_tokens(self) -> dict[str, int]:
        """Each control token's text (and the unknown token's): what llama.cpp's tokenizer reads as
        that one token when it parses special tokens, and as text when it does not. User-defined
        tokens (Gemma's <start_of_image>, Qwen's <think>) are not here: llama.cpp reads them as
        tokens either way. One pass over the vocabulary (0.2 s for Gemma 3's 262K tokens)."""
        wanted = C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN
        buf = ctypes.create_string_buffer(256)
        found: dict[str, int] = {}
        for token in range(self.n_vocab):
            if not C.llama_vocab_get_attr(self.vocab, token) & wanted:
                continue
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            text = buf.raw[:n].decode("utf-8", errors="replace")
            if text:
                found.setdefault(text, token)
        return found

    def detokenize(self, tokens: list[int]) -> str:
        """The tokens' text; an id outside the vocabulary raises, as `piece` does. Where every token
        was seen before, one dict lookup a token in C (as `pieces`)."""
        try:
            joined = b"".join(map(self._pieces.__getitem__, tokens))
        except KeyError:  # a token not seen yet (cached now), or one outside the vocabulary
            joined = b"".join(map(self.piece, tokens))
        return joined.decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(_is_eog_held(self.vocab, token))

    @functools.cached_property
    def eog_tokens(self) -> list[int]:
        """The vocabulary's end-of-generation tokens: a call per token (99 ms at the demo's 262K), once per
        model (the engine's sampling asks at build, not at a request's first min_tokens)."""
        return [token for token in range(self.n_vocab) if self.is_eog(token)]

    def shares_vocab(self, other: Model) -> bool:
        """Whether `other`'s token ids mean what this model's do (same size, and the same piece at
        512 ids spread over the vocabulary): a drafter's scores and a draft model's tokens must."""
        if self.n_vocab != other.n_vocab:
            return False
        step = max(1, self.n_vocab // 512)
        return all(self.piece(t) == other.piece(t) for t in range(0, self.n_vocab, step))

    def check_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
