"""Images and audio through libmtmd (issue 46): a projector loaded beside a text model, a prompt
with media markers cut into chunks (text tokens | media), a media chunk encoded into embeddings,
and the batch that decodes embeddings into one sequence of a context.

llama.cpp cannot mix embedding rows and token rows in one llama_decode, so media are decoded by
decode calls of their own (`MediaDecoder`: the pieces of several sequences share calls of at most
n_batch rows), which the engine runs before each step's token batch (engine/runner.py). Position
rules: a chunk of `n_tokens` embeddings takes `n_pos` positions; without M-RoPE they are equal and
consecutive. With M-RoPE (a text side of rope type mrope/imrope: the Qwen-VL families, Qwen3.5)
each embedding has 4 positions (t, y, x, z, as mtmd_image_tokens_get_decoder_pos gives them): an
image's nx x ny tokens all at t = its first position, y and x its row and column from there, and
it advances the position by n_pos = max(nx, ny) (`MediaChunk.positions`). Non-causal chunks (Gemma
3's images) are decoded whole, in one call, with causal attention off, as libmtmd's helper does."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import llama_cpp.llama_cpp as C
import numpy as np

from . import log as llama_log
from .context import Context
from .held import holding_gil_all
from .model import Model
from .ubatches import UbatchCounts

try:  # the wheel ships libmtmd unless it was built with -DLLAVA_BUILD=OFF
    import llama_cpp.mtmd_cpp as M
except (ImportError, OSError, FileNotFoundError):  # pragma: no cover - depends on the build
    M = None  # type: ignore[assignment]

MARKER = "<__media__>"  # libmtmd's default media marker, the one the prompts carry
_PSEUDO_SPACE = 1 << 30
# Pseudo-token ids (negative: never a vocabulary's). A chunk at plain positions takes ids in
# [-2^30, -1]. An M-RoPE image's ids lie below -2^30: its first n_pos in [-2^31 + 1, -2^30 - 1],
# its other n_tokens - n_pos all SAME_POSITION (cells that take no position of their own). So a
# token list alone says each index's position (engine/positions.py) and where an M-RoPE image is
# (whose cells share one KV position: never cut inside).
MROPE_IDS_BELOW = -_PSEUDO_SPACE
SAME_POSITION = -(1 << 31)
# libmtmd's helper hands bytes stb_image cannot decode (WebP, a corrupt file) to ffmpeg/ffprobe from
# this directory (NULL: $PATH): one that holds none, so a client's bytes never reach a subprocess
_NO_FFMPEG = b"/nonexistent/pflash-no-ffmpeg"

# libmtmd's small calls (a getter, a free, a chunk's copy), made holding the GIL. ctypes releases it
# around every foreign call, and taking it back waits out the switch interval (5 ms) while another
# thread runs Python (the engine thread, the event loop, other requests' preparation): a tokenize
# (20 calls) took 2 ms alone and 55 ms beside two busy Python threads, 18 ms with these held; an
# M-RoPE image's positions are two calls per token. The calls that decode, resize or encode media
# still release it (they run for ms and scale over cores).
_HELD = ("mtmd_input_chunks_init", "mtmd_input_chunks_free", "mtmd_input_chunks_size", "mtmd_input_chunks_get",
         "mtmd_input_chunk_get_type", "mtmd_input_chunk_get_tokens_text", "mtmd_input_chunk_copy",
         "mtmd_input_chunk_free", "mtmd_input_chunk_get_n_tokens", "mtmd_input_chunk_get_n_pos",
         "mtmd_input_chunk_get_tokens_image", "mtmd_image_tokens_get_decoder_pos", "mtmd_decode_use_non_causal",
         "mtmd_bitmap_free", "mtmd_helper_init_opt_default", "mtmd_get_output_embd")


Q: Any = holding_gil_all(M, _HELD) if M is not None else None


def mtmd_available() -> bool:
    """Whether this llama_cpp build has libmtmd (it has unless built with LLAVA off)."""
    return M is not None


class MediaError(ValueError):
    """A media item the projector cannot take (not an image it decodes, the wrong kind, too many
    tokens for the context's batch): the request's own fault, answered 400 / INVALID."""


@dataclass(frozen=True)
class TextChunk:
    tokens: list[int]


class MediaChunk:
    """One image or audio clip as libmtmd tokenized it: `n_tokens` embeddings at `n_pos`
    positions. `key` is a hash of its bytes (and kind): the embedding cache's key and the seed of
    the pseudo-token ids that stand for it in a slot's token list (`pseudo_tokens`). Owns a copy
    of the libmtmd chunk, freed with this object."""

    def __init__(self, raw: Any, kind: str, key: str, non_causal: bool, mrope: bool = False) -> None:
        self.raw, self.kind, self.key, self.non_causal = raw, kind, key, non_causal
        self.n_tokens: int = Q.mtmd_input_chunk_get_n_tokens(raw)
        self.n_pos: int = Q.mtmd_input_chunk_get_n_pos(raw)
        self.n_sections = 4 if mrope else 1  # positions per embedding (llama.cpp's n_pos_per_embd)
        self._free = weakref.finalize(self, Q.mtmd_input_chunk_free, raw)
        # an M-RoPE image's positions from its first: (t, y, x, z) = base + pos_0 * slope, per token
        self._mrope: tuple[np.ndarray, np.ndarray] | None = (
            _mrope_positions(raw, self.n_tokens) if mrope and kind == "image" else None)

    @property
    def mrope_image(self) -> bool:
        """An image at M-RoPE positions: its cells share one KV position (t)."""
        return self._mrope is not None

    def pseudo_tokens(self) -> list[int]:
        """Ids for its cells (n_tokens) that no vocabulary has (negative), derived from its bytes'
        hash: a resent image gives the same ids, so the prefix cache matches it like text. An
        M-RoPE image's lie below MROPE_IDS_BELOW, the n_tokens - n_pos after its first n_pos all
        SAME_POSITION (see there)."""
        base = int(self.key[:16], 16)
        if not self.mrope_image:
            return [-1 - ((base + i) % _PSEUDO_SPACE) for i in range(self.n_tokens)]
        head = [MROPE_IDS_BELOW - 1 - ((base + i) % (_PSEUDO_SPACE - 1)) for i in range(self.n_pos)]
        return head + [SAME_POSITION] * (self.n_tokens - self.n_pos)

    def positions(self, pos_0: int, offset: int = 0, n: int | None = None) -> np.ndarray:
        """Decoder positions of its embeddings offset..offset+n when it starts at position
        `pos_0`: [n_sections, n] int32, section-major as llama_batch.pos takes them (t, y, x, z
        with M-RoPE, as mtmd_helper_decode_image_chunk sets them; audio: pos_0 + i in each)."""
        n = self.n_tokens - offset if n is None else n
        if self._mrope is not None:
            base, slope = self._mrope
            return base[:, offset : offset + n] + pos_0 * slope[:, offset : offset + n]
        line = np.arange(pos_0 + offset, pos_0 + offset + n, dtype=np.int32)
        return np.broadcast_to(line, (self.n_sections, n)).copy()


def _mrope_positions(raw: Any, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """libmtmd's decoder positions of an image's tokens at pos_0 0 and 1, as (t, y, x, z) rows:
    the positions at any pos_0 are base + pos_0 * slope (each section is pos_0 plus a constant,
    or a constant)."""
    image = Q.mtmd_input_chunk_get_tokens_image(raw)
    at = np.empty((2, 4, n_tokens), dtype=np.int32)
    for pos_0 in (0, 1):
        for i in range(n_tokens):
            p = Q.mtmd_image_tokens_get_decoder_pos(image, pos_0, i)
            at[pos_0, :, i] = (p.t, p.y, p.x, p.z)
    return at[0], at[1] - at[0]


Chunk = TextChunk | MediaChunk


# hashlib releases the GIL for an update of 2,048 bytes or more, and taking it back cost the
# preparing thread up to the switch interval (held.py); an item up to HASH_HELD_BYTES is hashed in
# pieces under that, holding it (336 px PNG, 339 KB: 0.20 ms held, 0.19 released)
_HASH_PIECE = 2047
HASH_HELD_BYTES = 1 << 20


def media_key(kind: str, data: bytes) -> str:
    """The SHA-256 of an item's kind and bytes: the key of its KV (pseudo-token ids) and embeddings."""
    digest = hashlib.sha256(kind.encode() + b"\0")
    if len(data) > HASH_HELD_BYTES:
        digest.update(data)
        return digest.hexdigest()
    view = memoryview(data)
    for at in range(0, len(view), _HASH_PIECE):
        digest.update(view[at : at + _HASH_PIECE])
    return digest.hexdigest()


class Projector:
    """A multimodal projector (an mmproj GGUF) loaded by libmtmd for `model`, on the GPU where the
    model has layers there. `tokenize` may run on any thread (libmtmd's tokenizer is thread-safe);
    `encode` runs one at a time (one compute graph)."""

    def __init__(self, path: str | os.PathLike[str], model: Model, n_threads: int = 0,
                 use_gpu: bool | None = None, n_ubatch: int = 512) -> None:
        if M is None:
            raise RuntimeError("this llama_cpp build has no libmtmd (built with -DLLAVA_BUILD=OFF): "
                               "rebuild llama-cpp-python with LLAVA on to serve a projector")
        if not os.path.exists(path):
            raise FileNotFoundError(f"projector file not found: {path}")
        self.path, self.model, self.n_ubatch = os.fspath(path), model, n_ubatch
        for route in (M.mtmd_log_set, M.mtmd_helper_log_set):  # libmtmd's log with llama.cpp's (llama/log.py)
            route(llama_log.sink(), ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.use_gpu = model.n_gpu_layers != 0 if use_gpu is None else use_gpu
        params.print_timings = False
        if n_threads > 0:
            params.n_threads = n_threads
        self._marker = MARKER.encode()  # referenced: libmtmd copies it, but only at init
        params.media_marker = self._marker
        self.ptr = M.mtmd_init_from_file(self.path.encode(), model.ptr, params)
        if not self.ptr:
            raise ValueError(f"libmtmd could not load the projector {self.path} for the model {model.path} "
                             "(not an mmproj GGUF, or made for a model of another width)")
        self._free = weakref.finalize(self, M.mtmd_free, self.ptr)
        self.mrope: bool = bool(M.mtmd_decode_use_mrope(self.ptr))  # the text side's rope type decides
        self.vision: bool = bool(M.mtmd_support_vision(self.ptr))
        self.audio: bool = bool(M.mtmd_support_audio(self.ptr))
        self.n_embd: int = C.llama_model_n_embd_inp(model.ptr)
        self._encoding = threading.Lock()
        self._counting = threading.Lock()
        self.tokenized_items, self.tokenize_s = 0, 0.0  # since start, for /status: libmtmd's decode + resize
        self.encoded = 0  # encodes begun

    def close(self) -> None:
        self._free()

    def tokenize(self, text: str, media: Sequence[tuple[str, bytes]]) -> list[Chunk]:
        """The prompt `text` (one MARKER per item of `media`, in order; special tokens parsed, none
        added: the chat template wrote them) as text and media chunks. `media`: (kind, bytes).
        MediaError for an item libmtmd cannot decode or the wrong number of markers."""
        start = time.perf_counter()
        try:
            with self.tokenized(text, media) as chunks:
                return self._chunks(chunks, [media_key(kind, data) for kind, data in media])
        finally:
            with self._counting:
                self.tokenized_items += len(media)
                self.tokenize_s += time.perf_counter() - start

    @contextlib.contextmanager
    def tokenized(self, text: str, media: Sequence[tuple[str, bytes]]) -> Iterator[Any]:
        """libmtmd's chunks of the prompt (mtmd_input_chunks *), freed on exit."""
        self._check_kinds(media)
        if text.count(MARKER) != len(media):
            raise MediaError(f"the prompt has {text.count(MARKER)} media markers for {len(media)} media items")
        bitmaps: list[Any] = []
        chunks = Q.mtmd_input_chunks_init()
        try:
            bitmaps += [self._bitmap(kind, data, i) for i, (kind, data) in enumerate(media)]
            encoded = text.encode()
            inp = M.mtmd_input_text()
            inp.text, inp.text_len, inp.add_special, inp.parse_special = encoded, len(encoded), False, True
            array = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            code = M.mtmd_tokenize(self.ptr, chunks, ctypes.byref(inp), array, len(bitmaps))
            if code != 0:
                raise MediaError(f"libmtmd could not preprocess the media (error {code})")
            yield chunks
        finally:
            Q.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                Q.mtmd_bitmap_free(bitmap)

    def _check_kinds(self, media: Sequence[tuple[str, bytes]]) -> None:
        for kind, _ in media:
            if (kind == "image" and not self.vision) or (kind == "audio" and not self.audio):
                raise MediaError(f"this model's projector takes no {kind} input")

    def _bitmap(self, kind: str, data: bytes, index: int) -> Any:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        opt = Q.mtmd_helper_init_opt_default()
        opt.video_params.ffmpeg_bin_dir = _NO_FFMPEG  # never run ffmpeg/ffprobe on a client's bytes
        wrapper = M.mtmd_helper_bitmap_init_from_buf_wrapper(self.ptr, buf, len(data), False, opt)
        if wrapper.video_ctx:
            M.mtmd_helper_video_free(wrapper.video_ctx)
            raise MediaError(f"media item {index}: a video, which is not served")
        bitmap = wrapper.bitmap
        if not bitmap:
            raise MediaError(f"media item {index}: libmtmd could not decode this {kind} "
                             "(a corrupt file or an unsupported format)")
        return bitmap

    def _chunks(self, chunks: Any, keys: list[str]) -> list[Chunk]:
        out: list[Chunk] = []
        media = iter(keys)
        for i in range(Q.mtmd_input_chunks_size(chunks)):
            raw = Q.mtmd_input_chunks_get(chunks, i)
            kind = Q.mtmd_input_chunk_get_type(raw)
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                tokens = Q.mtmd_input_chunk_get_tokens_text(raw, ctypes.byref(n))
                if n.value:
                    out.append(TextChunk([int(tokens[j]) for j in range(n.value)]))
                continue
            name = "image" if kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE else "audio"
            chunk = MediaChunk(Q.mtmd_input_chunk_copy(raw), name, next(media),
                               bool(Q.mtmd_decode_use_non_causal(self.ptr, raw)), self.mrope)
            if chunk.non_causal and chunk.n_tokens > self.n_ubatch:
                raise MediaError(f"this {name} takes {chunk.n_tokens} tokens, decoded in one ubatch: "
                                 f"more than n_ubatch ({self.n_ubatch})")
            out.append(chunk)
        return out

    def encode(self, chunk: MediaChunk) -> np.ndarray:
        """The chunk's embeddings, [n_tokens, n_embd] float32 (a copy: libmtmd reuses its buffer)."""
        with self._encoding:
            self.encoded += 1
            if M.mtmd_encode_chunk(self.ptr, chunk.raw) != 0:
                raise MediaError(f"libmtmd failed to encode the {chunk.kind}")
            out = Q.mtmd_get_output_embd(self.ptr)
            flat = np.ctypeslib.as_array(out, shape=(chunk.n_tokens * self.n_embd,))
            return flat.reshape(chunk.n_tokens, self.n_embd).copy()


class EmbeddingBatch:
    """A llama_batch of embedding rows (llama_batch_init with embd > 0: no token array), for one
    or more sequences, `capacity` rows at most; Context.decode takes it like a token Batch. With
    M-RoPE (`n_sections` 4) llama.cpp reads n_tokens * 4 positions, section-major over the rows
    the batch holds at decode: `pos` points at an array of ours laid out so (`add`)."""

    def __init__(self, capacity: int, n_embd: int, n_sections: int = 1) -> None:
        self.capacity, self.n_embd, self.n_sections = capacity, n_embd, n_sections
        self.raw = C.llama_batch_init(capacity, n_embd, 1)
        self.n_tokens = 0
        self._embd = np.ctypeslib.as_array(self.raw.embd, shape=(capacity, n_embd))
        self._n_seq_id, self._logits = (np.ctypeslib.as_array(a, shape=(capacity,))
                                        for a in (self.raw.n_seq_id, self.raw.logits))
        # the address llama_batch_free frees, put back before (an int: a ctypes pointer read from a
        # struct's field is a view of that field, so it would follow our assignment below)
        self._own_pos: int = ctypes.cast(self.raw.pos, ctypes.c_void_p).value or 0
        self._sections = np.zeros((n_sections, capacity), dtype=np.int32)  # rows' positions by section
        self._flat = np.zeros(n_sections * capacity, dtype=np.int32)  # what llama.cpp reads
        if n_sections > 1:
            self.raw.pos = self._flat.ctypes.data_as(ctypes.POINTER(C.llama_pos))
        else:
            self._flat = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))

    @property
    def room(self) -> int:
        return self.capacity - self.n_tokens

    def clear(self) -> None:
        self.n_tokens = self.raw.n_tokens = 0

    def add(self, rows: np.ndarray, positions: np.ndarray, seq_id: int) -> None:
        """Append `rows` ([n, n_embd]) of `seq_id` at `positions` ([n_sections, n]), no outputs."""
        first, n = self.n_tokens, len(rows)
        if not 0 < n <= self.room:
            raise OverflowError(f"{n} embedding rows for a batch with room for {self.room}")
        end = first + n
        self._embd[first:end] = rows
        self._sections[:, first:end] = positions
        self._n_seq_id[first:end] = 1
        self._logits[first:end] = 0
        for i in range(first, end):
            self.raw.seq_id[i][0] = seq_id
        self.n_tokens = self.raw.n_tokens = end
        # section-major with a stride of the rows held: pos[j * n_tokens + i]
        self._flat[: self.n_sections * end] = self._sections[:, :end].reshape(-1)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.pos = ctypes.cast(self._own_pos, ctypes.POINTER(C.llama_pos))
            C.llama_batch_free(self.raw)
            self.raw = None

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class MediaPiece:
    """Embedding rows to decode into sequence `seq_id` at `positions` ([n_sections, n]:
    MediaChunk.positions)."""

    rows: np.ndarray
    positions: np.ndarray
    seq_id: int
    non_causal: bool = False


@dataclass
class DecodeCounts:
    """What a MediaDecoder did since start (the engine thread writes, /status reads: plain ints and
    a float, each read whole): its llama_decode calls, the embedding rows and pieces they took, and
    their seconds (each decode() waited to its end, so a GPU's asynchronous return hides none)."""

    calls: int = 0
    rows: int = 0
    pieces: int = 0
    seconds: float = 0.0


class MediaDecoder:
    """Decodes a step's media pieces into their sequences of `ctx` by calls of their own (llama.cpp
    takes no token rows beside embedding rows): the causal pieces of all sequences share calls of at
    most n_batch rows (a piece split across two keeps its order); a non-causal piece (decoded whole)
    gets a call of its own with causal attention off."""

    def __init__(self, ctx: Context, ubatches: UbatchCounts | None = None) -> None:
        self.ctx = ctx
        self.batch: EmbeddingBatch | None = None
        self.counts = DecodeCounts()
        self.ubatches = ubatches or UbatchCounts()  # the calls' ubatches and reused graphs
        self._runs: list[tuple[int, int]] = []  # the batch's rows as (sequence, rows), for `ubatches`

    def decode(self, pieces: Sequence[MediaPiece]) -> None:
        """Raises DecodeError as Context.decode does (what was written stays: the caller trims)."""
        if not pieces:
            return
        start = time.perf_counter()
        try:
            self._decode(pieces)
            self.ctx.synchronize()  # the calls' time is the step's media phase (the token batch waits on it anyway)
        finally:
            self.counts.pieces += len(pieces)
            self.counts.seconds += time.perf_counter() - start

    def _decode(self, pieces: Sequence[MediaPiece]) -> None:
        batch = self._batch(pieces[0].rows.shape[1], len(pieces[0].positions))
        for piece in [p for p in pieces if not p.non_causal]:
            at = 0
            while at < len(piece.rows):
                take = min(batch.room, len(piece.rows) - at)
                batch.add(piece.rows[at : at + take], piece.positions[:, at : at + take], piece.seq_id)
                self._runs.append((piece.seq_id, take))
                at += take
                if not batch.room:
                    self._flush(batch, False)
        self._flush(batch, False)
        for piece in [p for p in pieces if p.non_causal]:
            batch.add(piece.rows, piece.positions, piece.seq_id)
            self._runs.append((piece.seq_id, len(piece.rows)))
            self._flush(batch, True)

    def _batch(self, n_embd: int, n_sections: int) -> EmbeddingBatch:
        if self.batch is None or (self.batch.n_embd, self.batch.n_sections) != (n_embd, n_sections):
            self.close()
            self.batch = EmbeddingBatch(self.ctx.n_batch, n_embd, n_sections)
        return self.batch

    def _flush(self, batch: EmbeddingBatch, non_causal: bool) -> None:
        if not batch.n_tokens:
            return
        if non_causal:
            C.llama_set_causal_attn(self.ctx.ptr, False)
        self.counts.calls += 1
        self.counts.rows += batch.n_tokens
        try:
            self.ubatches.media.decode(self.ctx, batch, self._runs)
        finally:
            batch.clear()
            self._runs = []
            if non_causal:
                C.llama_set_causal_attn(self.ctx.ptr, True)

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
            self.batch = None


def helper_eval(projector: Projector, ctx: Context, text: str, media: Sequence[tuple[str, bytes]],
                n_batch: int) -> int:
    """llama.cpp's own path for a prompt with media: libmtmd tokenizes it and
    mtmd_helper_eval_chunks decodes every chunk into sequence 0 of `ctx` (logits of the last
    token); returns the positions taken. The reference the engine's parity test compares with."""
    with projector.tokenized(text, media) as chunks:
        n_past = C.llama_pos(0)
        if M.mtmd_helper_eval_chunks(projector.ptr, ctx.ptr, chunks, 0, 0, n_batch, True, ctypes.byref(n_past)) != 0:
            raise RuntimeError("mtmd_helper_eval_chunks failed")
        return int(n_past.value)


def helper_decode_chunk(projector: Projector, ctx: Context, chunk: MediaChunk, n_past: int, n_batch: int) -> int:
    """llama.cpp's own decode of one media chunk into sequence 0 of `ctx` from position `n_past`
    (mtmd_helper_decode_image_chunk: its positions, M-RoPE's too, set by libmtmd); returns the
    position after it. The reference for a prompt laid out by hand (tests: PFlash's kept tokens)."""
    rows = np.ascontiguousarray(projector.encode(chunk), dtype=np.float32)
    new_n_past = C.llama_pos(0)
    embd = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    no_callback = M.mtmd_helper_decode_image_chunk.argtypes[8]()  # NULL: no post-decode callback
    code = M.mtmd_helper_decode_image_chunk(projector.ptr, ctx.ptr, chunk.raw, embd, n_past, 0, n_batch,
                                            ctypes.byref(new_n_past), no_callback, None)
    if code != 0:
        raise RuntimeError(f"mtmd_helper_decode_image_chunk failed ({code})")
    return int(new_n_past.value)
