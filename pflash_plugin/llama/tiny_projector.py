"""A tiny random-weight LLaVA-style projector GGUF (issue 46): clip.cpp's `mlp` projector (the
fewest tensors a loader of libmtmd takes: a patch embedding, position embeddings, ViT blocks and
a two-layer MLP) over a tiny ViT, its output the width of a tiny text model (tiny_gguf.TinyLlama's
n_embd). Tests pair it with `cached_tiny_llama`; benches write one at a real shape. `kind`
"gemma3" writes Gemma 3's projector instead, whose images libmtmd decodes non-causally.

LLaVA's graph runs the ViT's blocks up to the second to last (clip.cpp, models/llava.cpp), so
`n_layer` 2 runs one block. An image is resized and padded to `image_size` square and cut into
(image_size / patch_size)^2 patches: one embedding, one position each (no M-RoPE, causal decode).

`kind` "qwen2vl" writes Qwen2-VL's projector (clip.cpp's `qwen2vl_merger`: two patch convolutions
summed, a ViT with 2-D rotary positions, each 2x2 patches merged by an MLP): an image keeps its
aspect (resized to a multiple of 2 patches), nx x ny tokens that a text model with M-RoPE
(tiny_gguf's arch "qwen2vl") reads at max(nx, ny) positions.

`kind` "qwen2a" writes an audio projector instead (Qwen2-Audio's, clip.cpp's `qwen2a`: a Whisper
encoder, two 1-D convolutions over `n_mel` mel bins, ViT blocks, 2x average pooling, one
projection): libmtmd cuts a clip into 30 s windows of 3000 mel frames, 750 tokens each, between
the text `<|audio_bos|>` and `<|audio_eos|>`."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .tiny_gguf import cached_gguf, finish


@dataclass(frozen=True)
class TinyProjector:
    n_embd_text: int = 64  # the text model's n_embd (mtmd refuses a projector of another width)
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 64  # != n_embd: clip.cpp swaps up/down of old LLaVA files whose down is n_embd wide
    n_layer: int = 2
    image_size: int = 64
    patch_size: int = 8
    n_mlp: int = 64  # the MLP's hidden width
    seed: int = 0
    kind: str = "mlp"  # or "gemma3": a SigLIP ViT, 2x2 average pooling, RMS norm, one projection; non-causal;
    # or "qwen2vl": Qwen2-VL's merger (M-RoPE positions, an image's tokens from its size)
    f16: bool = False  # the blocks' and the MLP's matrices in F16, as real mmproj files (a bench's real shape)
    n_mel: int = 16  # qwen2a: mel bins the encoder reads

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_image_tokens(self) -> int:
        """The tokens of every image (a fixed-size projector; gemma3 pools 2x2 patches into one);
        qwen2vl: of an image_size square one (it merges 2x2 patches, and an image keeps its aspect)."""
        return self.n_patches // (1 if self.kind == "mlp" else 4)

    def write(self, path: str | os.PathLike[str]) -> pathlib.Path:
        import gguf

        path = pathlib.Path(path)
        w = gguf.GGUFWriter(path, "clip")
        w.add_name("pflash-tiny-projector")
        if self.kind == "qwen2a":
            return self._write_audio(w, path)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_string("clip.projector_type", "qwen2vl_merger" if self.kind == "qwen2vl" else self.kind)
        if self.kind == "gemma3":
            w.add_uint32("clip.vision.projector.scale_factor", 2)  # Gemma 3's own pools 4x4
        w.add_bool("clip.use_gelu", True)
        for key, value in (("embedding_length", self.n_embd), ("attention.head_count", self.n_head),
                           ("feed_forward_length", self.n_ff), ("block_count", self.n_layer),
                           ("projection_dim", self.n_embd_text), ("image_size", self.image_size),
                           ("patch_size", self.patch_size)):
            w.add_uint32(f"clip.vision.{key}", value)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        for name, array in self._tensors():
            matrix = array.ndim == 2 and name != "v.position_embd.weight"
            w.add_tensor(name, array.astype(np.float16) if self.f16 and matrix else array)
        finish(w)
        return path

    def _write_audio(self, w: Any, path: pathlib.Path) -> pathlib.Path:
        """Qwen2-Audio's projector (kind "qwen2a"): clip.cpp's names under `a.` and its audio keys."""
        rng = np.random.default_rng(self.seed)

        def draw(*shape: int, scale: float = 0.1) -> np.ndarray[Any, Any]:
            return (scale * rng.standard_normal(shape)).astype(np.float32)

        d = self.n_embd
        w.add_bool("clip.has_audio_encoder", True)
        w.add_string("clip.projector_type", "qwen2a")
        for key, value in (("embedding_length", d), ("attention.head_count", self.n_head),
                           ("feed_forward_length", self.n_ff), ("block_count", self.n_layer),
                           ("projection_dim", self.n_embd_text), ("num_mel_bins", self.n_mel)):
            w.add_uint32(f"clip.audio.{key}", value)
        w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
        # the convolutions' kernels in F16 (ggml's im2col path, as converted Whisper files have them),
        # their biases [channels, 1]: added along the channels of a [frames, channels] result
        tensors = [("a.conv1d.1.weight", draw(d, self.n_mel, 3).astype(np.float16)), ("a.conv1d.1.bias", draw(d, 1)),
                   ("a.conv1d.2.weight", draw(d, d, 3).astype(np.float16)), ("a.conv1d.2.bias", draw(d, 1)),
                   ("a.position_embd.weight", draw(1500, d))]  # 3000 frames, halved by the second conv
        for i in range(self.n_layer):
            blk = f"a.blk.{i}"
            for name, shape, bias in (("attn_q", (d, d), True), ("attn_k", (d, d), False), ("attn_v", (d, d), True),
                                      ("attn_out", (d, d), True), ("ffn_up", (self.n_ff, d), True),
                                      ("ffn_down", (d, self.n_ff), True)):
                tensors += [(f"{blk}.{name}.weight", draw(*shape))] + ([(f"{blk}.{name}.bias", draw(shape[0]))] * bias)
            for norm in ("ln1", "ln2"):
                tensors += [(f"{blk}.{norm}.weight", np.ones(d, np.float32)), (f"{blk}.{norm}.bias", draw(d))]
        tensors += [("a.post_ln.weight", np.ones(d, np.float32)), ("a.post_ln.bias", draw(d)),
                    ("mm.a.fc.weight", draw(self.n_embd_text, d, scale=0.05)),
                    ("mm.a.fc.bias", draw(self.n_embd_text, scale=0.02))]
        for name, array in tensors:
            w.add_tensor(name, array)
        finish(w)
        return path

    def _tensors(self) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """clip.cpp's names; numpy shapes are ggml's ne reversed ([out, in] for a matrix)."""
        rng = np.random.default_rng(self.seed)

        def draw(*shape: int, scale: float = 0.1) -> np.ndarray[Any, Any]:
            return (scale * rng.standard_normal(shape)).astype(np.float32)

        d, p = self.n_embd, self.patch_size
        if self.kind == "qwen2vl":  # two frames' convolutions, no bias, positions by rotation (clip.cpp)
            tensors = [("v.patch_embd.weight", draw(d, 3, p, p)), ("v.patch_embd.weight.1", draw(d, 3, p, p))]
        else:
            tensors = [("v.patch_embd.weight", draw(d, 3, p, p)), ("v.patch_embd.bias", draw(d)),
                       ("v.position_embd.weight", draw(self.n_patches, d))]
        for i in range(self.n_layer):
            blk = f"v.blk.{i}"
            for name, shape in (("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_out", (d, d)),
                                ("ffn_up", (self.n_ff, d)), ("ffn_down", (d, self.n_ff))):
                tensors += [(f"{blk}.{name}.weight", draw(*shape)), (f"{blk}.{name}.bias", draw(shape[0]))]
            for norm in ("ln1", "ln2"):
                tensors += [(f"{blk}.{norm}.weight", np.ones(d, np.float32)), (f"{blk}.{norm}.bias", draw(d))]
        if self.kind == "gemma3":  # the projection's ne is [n_embd_text, n_embd]: clip.cpp transposes it
            return tensors + [("mm.soft_emb_norm.weight", np.ones(d, np.float32)),
                              ("mm.input_projection.weight", draw(d, self.n_embd_text, scale=0.05))]
        # the MLP's output scaled like the text model's token embeddings (tiny_gguf: 0.02 * N(0, 1));
        # Qwen2-VL's merger reads 2x2 patches at once
        merged = 4 * d if self.kind == "qwen2vl" else d
        tensors += [("mm.0.weight", draw(self.n_mlp, merged)), ("mm.0.bias", draw(self.n_mlp)),
                    ("mm.2.weight", draw(self.n_embd_text, self.n_mlp, scale=0.05)),
                    ("mm.2.bias", draw(self.n_embd_text, scale=0.02))]
        return tensors


def cached_tiny_projector(**kw: Any) -> pathlib.Path:
    """The TinyProjector of `kw` (its fields as keywords), written once per process (atomically,
    tiny_gguf.cached_gguf) and then reused."""
    spec = TinyProjector(**kw)
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    return cached_gguf(key, f"mmproj-{key}.gguf", spec.write)
