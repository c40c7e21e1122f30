"""Tiny random-weight llama GGUF models: the AMX probe's (llama/amx_probe.py, at start-up), the
tests' (through pflash_plugin.testing) and the GPU benches' at real shapes.

Real weights are slow to load and need a download; tests of serving/plumbing only
need a model that llama.cpp loads, tokenizes any text with (SentencePiece byte
fallback) and generates deterministically from. Needs the ``gguf`` package.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# ChatML, the format most chat models use; <|im_start|>/<|im_end|> are CONTROL tokens.
# Starts with bos_token because llama-cpp-python's Jinja2ChatFormatter never adds BOS
# itself (it reports added_special=True), while this model says add_bos_token=True.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the of and to a in is you that it he was for on are as with his they I at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part over "
    "new sound take only little work know place year live me back give most very after thing our "
    "just name good sentence man think say great where help through much before line right too "
    "mean old any same tell boy follow came want show also around form three small set put end "
    "does another well large must big even such because turn here why ask went men read need "
    "land different home us move try kind hand picture again change off play spell air away "
    "animal house point page letter mother answer found study still learn should world hello "
    "Hello World The model test token prompt"
).split()

_SPACE = "\u2581"  # SentencePiece's visible space
_UNK, _BOS, _EOS = 0, 1, 2
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6  # gguf.TokenType values


def tiny_vocab(vocab_extra: int = 0, control: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    """Return (tokens, scores, token_types) of the byte-fallback SPM vocabulary.

    llama.cpp's SPM tokenizer only merges adjacent pieces whose concatenation is in
    the vocab, so every prefix of "▁word" and "word" is added to make whole words
    reachable (the bare form covers text start and words after a newline).
    """
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    scores = [0.0] * len(tokens)
    seen: set[str] = set()
    pieces = [_SPACE] + [chr(c) for c in range(33, 127)]
    for word in _WORDS:
        for form in (_SPACE + word, word):
            pieces += [form[:i] for i in range(2, len(form) + 1)]
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(_NORMAL)
            scores.append(float(len(piece)))  # higher score merges first: prefer long pieces
    for special in ("<|im_start|>", "<|im_end|>", *control):
        tokens.append(special)
        types.append(_CONTROL)
        scores.append(0.0)
    for i in range(vocab_extra):  # only to change n_vocab (vocabulary-mismatch tests)
        tokens.append(f"<extra_{i}>")
        types.append(_NORMAL)
        scores.append(-1000.0)
    return tokens, scores, types


@dataclass(frozen=True)
class TinyLlama:
    """A deterministic random-weight llama GGUF's shape and options; `write` writes it.

    ``vocab_extra`` appends dummy tokens so n_vocab differs (vocab-mismatch tests).
    ``tiled`` draws one random array per tensor shape and repeats it in every layer: an 8B-class
    F16 model then writes in about a minute (for timing; weights repeat across layers).
    ``quant`` ("q8_0", "q4_0") quantizes the layers' matrices: the types that ggml's AMX and
    repacked CPU kernels take (the AMX probe needs them; F32 and F16 never reach those kernels).
    ``per_layer_kv_heads`` writes head_count_kv as one entry per layer, as some models do
    (llama.cpp takes either; a cut copy must shorten the array).
    ``control_tokens`` adds CONTROL tokens after ChatML's (a family's markers that are control
    tokens in its vocabulary, as Magistral's ``[THINK]``).
    ``add_space_prefix`` defaults to False (like Gemma) so detokenize(tokenize(s)) == s
    even without BOS; True mimics Llama-2/Mistral, whose leading " " llama-cpp-python
    only strips when the first token is BOS.
    """

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 4096
    seed: int = 0
    chat_template: str | None = CHATML_TEMPLATE
    vocab_extra: int = 0
    f16: bool = False
    add_space_prefix: bool = False
    tiled: bool = False
    quant: str | None = None
    per_layer_kv_heads: bool = False
    control_tokens: tuple[str, ...] = ()
    arch: str = "llama"  # or "qwen2vl": the same weights read at M-RoPE positions (Qwen2-VL's text side)
    sliding_window: int = 0  # with arch "gemma3": n_swa, every 6th layer full (the iSWA KV cache's shape)
    scale: float = 0.02  # the weights' spread; larger makes attention (the context) steer the text more

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def write(self, path: str | os.PathLike[str]) -> pathlib.Path:
        import gguf

        path = pathlib.Path(path)
        vocab = tiny_vocab(self.vocab_extra, tuple(self.control_tokens))
        w = gguf.GGUFWriter(path, self.arch)
        self._add_metadata(w, vocab)
        self._add_tensors(w, vocab)
        finish(w)
        return path

    def _add_metadata(self, w: Any, vocab: tuple[list[str], list[float], list[int]]) -> None:
        import gguf

        tokens, scores, types = vocab
        if self.quant:
            file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{self.quant.upper()}")
        else:
            file_type = gguf.LlamaFileType.MOSTLY_F16 if self.f16 else gguf.LlamaFileType.ALL_F32
        w.add_name("pflash-tiny-llama")
        w.add_file_type(int(file_type))
        w.add_context_length(self.n_ctx_train)
        w.add_embedding_length(self.n_embd)
        w.add_block_count(self.n_layer)
        w.add_feed_forward_length(self.n_ff)
        w.add_head_count(self.n_head)
        w.add_head_count_kv([self.n_head_kv] * self.n_layer if self.per_layer_kv_heads else self.n_head_kv)
        w.add_rope_dimension_count(self.head_dim)
        if self.arch == "qwen2vl":  # M-RoPE: the rotary pairs split over (t, y, x) as Qwen2-VL's 16/24/24 of 64
            pairs = self.head_dim // 2
            w.add_rope_dimension_sections([pairs - 2 * (3 * pairs // 8), 3 * pairs // 8, 3 * pairs // 8, 0])
        w.add_layer_norm_rms_eps(1e-5)
        if self.arch == "gemma3":
            w.add_sliding_window(self.sliding_window)
        w.add_vocab_size(len(tokens))
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(_BOS)
        w.add_eos_token_id(_EOS)
        w.add_unk_token_id(_UNK)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            w.add_chat_template(self.chat_template)

    def _add_tensors(self, w: Any, vocab: tuple[list[str], list[float], list[int]]) -> None:
        """Dim 0 of the residual stream is a constant "bias" channel: every embedding has +0.2
        there and output rows of tokens a test should never see generated (unk/bos/eos, control
        tokens, bytes other than "\n") read it with weight -2, a logit penalty of ~-8 against a
        random spread of ~0.15. Stray bytes >= 0x80 would make llama-cpp-python emit invalid
        UTF-8 and overshoot max_tokens; an EOS would end generations early. So the model always
        writes plain ASCII up to max_tokens."""
        tokens, _, types = vocab
        draw = _Draw(self)
        # a copy: tiled, both draws are one array, and the bias channel below must differ between them
        embd, out = draw.array(len(tokens), self.n_embd), draw.array(len(tokens), self.n_embd).copy()
        embd[:, 0], out[:, 0] = 0.2, 0.0
        banned = [i for i, t in enumerate(types) if t not in (_NORMAL, _BYTE)]
        banned += [i for i, t in enumerate(types) if t == _BYTE and tokens[i] != "<0x0A>"]
        out[banned, 0] = -2.0

        d, kv, ff = self.n_embd, self.n_head_kv * self.head_dim, self.n_ff
        ones = np.ones(d, dtype=np.float32)  # norms stay F32 (llama.cpp expects it)
        w.add_tensor("token_embd.weight", embd)
        for i in range(self.n_layer):
            w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            for name, shape in (("attn_q", (d, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, d))):
                w.add_tensor(f"blk.{i}.{name}.weight", **draw.matrix(*shape))
            w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
            for name, shape in (("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))):
                w.add_tensor(f"blk.{i}.{name}.weight", **draw.matrix(*shape))
            if self.arch == "gemma3":  # its q/k norms and the norms after attention and the FFN
                for name in ("attn_q_norm", "attn_k_norm"):
                    w.add_tensor(f"blk.{i}.{name}.weight", np.ones(self.head_dim, dtype=np.float32))
                for name in ("post_attention_norm", "post_ffw_norm"):
                    w.add_tensor(f"blk.{i}.{name}.weight", ones)
        w.add_tensor("output_norm.weight", ones)
        w.add_tensor("output.weight", out)


class _Draw:
    """Random weights in the model's type, drawn in writing order from its seed; tiled, one array
    per shape is drawn once and repeated."""

    def __init__(self, spec: TinyLlama) -> None:
        self.spec, self.rng = spec, np.random.default_rng(spec.seed)
        self.dtype = np.float16 if spec.f16 else np.float32
        self.drawn: dict[tuple[int, ...], np.ndarray[Any, Any]] = {}

    def array(self, *shape: int) -> np.ndarray[Any, Any]:
        # numpy shape is ggml ne reversed: [rows=out, cols=in] gives ne=[in, out]
        if self.spec.tiled and shape in self.drawn:
            return self.drawn[shape]
        array = (self.spec.scale * self.rng.standard_normal(shape)).astype(self.dtype)
        if self.spec.tiled:
            self.drawn[shape] = array
        return array

    def matrix(self, *shape: int) -> dict[str, Any]:
        """add_tensor arguments of a layer matrix: quantized when asked."""
        array = self.array(*shape)
        if not self.spec.quant:
            return {"tensor": array}
        import gguf

        qtype = getattr(gguf.GGMLQuantizationType, self.spec.quant.upper())
        return {"tensor": gguf.quants.quantize(array.astype(np.float32), qtype), "raw_dtype": qtype}


def finish(w: Any) -> None:
    """A gguf.GGUFWriter's file written out (header, metadata, tensors, in gguf's order) and closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(path: str | os.PathLike[str], **spec: Any) -> pathlib.Path:
    """Write the TinyLlama of `spec` (its fields as keywords) to ``path`` and return it."""
    return TinyLlama(**spec).write(path)


def write_tiny_lora(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    rank: int = 4,
    seed: int = 1,
) -> pathlib.Path:
    """A LoRA adapter GGUF for the default tiny llama (its n_layer and n_embd): random low-rank
    deltas on every layer's Q and on the output matrix, large enough to move the logits."""
    import gguf

    path = pathlib.Path(path)
    n_vocab = len(tiny_vocab()[0])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    targets = [f"blk.{i}.attn_q.weight" for i in range(n_layer)]
    for name, n_out in [(t, n_embd) for t in targets] + [("output.weight", n_vocab)]:
        # numpy shapes are ggml ne reversed: lora_a ne=[n_in, rank], lora_b ne=[rank, n_out]
        w.add_tensor(f"{name}.lora_a", (0.5 * rng.standard_normal((rank, n_embd))).astype(np.float32))
        w.add_tensor(f"{name}.lora_b", (0.5 * rng.standard_normal((n_out, rank))).astype(np.float32))
    finish(w)
    return path


def tiny_model_path(tmp_dir: str | os.PathLike[str], **kw: Any) -> pathlib.Path:
    """Write a tiny model into ``tmp_dir`` (e.g. pytest's tmp_path) and return its path."""
    return write_tiny_llama(pathlib.Path(tmp_dir) / "tiny-llama.gguf", **kw)


_CACHE: dict[str, pathlib.Path] = {}


def cached_gguf(key: str, name: str, write: Callable[[str], object]) -> pathlib.Path:
    """The file `name` (keyed by `key`) under the temp dir's pflash_tiny_models, written by `write`
    once per process and then reused.

    Rewritten (atomically) on the first call in each process so a stale file from an
    older generator version can never be picked up; concurrent writers are safe.
    """
    cached = _CACHE.get(key)
    if cached is not None and cached.exists():
        return cached
    out_dir = pathlib.Path(tempfile.gettempdir()) / "pflash_tiny_models"
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / name
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".gguf.tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _CACHE[key] = final
    return final


def cached_tiny_llama(**kw: Any) -> pathlib.Path:
    """Return a tiny model for ``kw``, written once per process and then reused (cached_gguf)."""
    key = hashlib.sha256(
        json.dumps(sorted(kw.items()), default=str).encode()
    ).hexdigest()[:16]
    return cached_gguf(key, f"{key}.gguf", lambda path: write_tiny_llama(path, **kw))
