"""Eval-callback capture of attention Q and K at chosen layers, stopping the graph after them.

llama.cpp calls the callback for every graph node with ask=true ("do you want this node?") and
again with ask=false once a wanted node's data is ready; returning false then aborts the graph,
so a drafter never computes the layers after its last scoring layer. Node names are
"<name>-<layer>"; several nodes share a name (matmul, reshape, RoPE), so the op picks one.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import time
from dataclasses import dataclass, field

import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as C

def _loaded_ggml_base() -> ctypes.CDLL:
    """The ggml-base that libllama already uses. The wheel ships libggml-base.so, .so.0 and
    .so.0.25.3 as separate copies (not symlinks): opening another copy would load a second ggml
    with its own global state (it crashed the CUDA build with free(): invalid pointer). RTLD_NOLOAD
    returns the instance already loaded under its SONAME."""
    try:
        return ctypes.CDLL("libggml-base.so.0", mode=os.RTLD_NOLOAD)
    except OSError:  # not loaded under that name (another platform): the same file llama_cpp uses
        lib_dir = pathlib.Path(os.path.dirname(llama_cpp.__file__)) / "lib"
        return ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))


_ggml = _loaded_ggml_base()
_ggml.ggml_get_name.restype = ctypes.c_char_p
_ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
_ggml.ggml_op_desc.restype = ctypes.c_char_p
_ggml.ggml_op_desc.argtypes = [ctypes.c_void_p]
_ggml.ggml_nbytes.restype = ctypes.c_size_t
_ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
_ggml.ggml_is_contiguous.restype = ctypes.c_bool
_ggml.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
_ggml.ggml_backend_tensor_get.restype = None
_ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

_GGML_TYPE_F32, _GGML_TYPE_F16 = 0, 1


class _TensorHead(ctypes.Structure):
    """The leading fields of struct ggml_tensor (stable across ggml versions)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


@dataclass
class CaptureSpec:
    layers: list[int]
    head_dim: int
    n_head: int
    n_head_kv: int
    rope: str = "post"  # "post": the RoPE node's output; "pre": the last Q/K node before RoPE


@dataclass
class Captured:
    q: dict[int, list[np.ndarray]] = field(default_factory=dict)  # layer -> per-ubatch [n, n_head, head_dim]
    k: dict[int, list[np.ndarray]] = field(default_factory=dict)
    q_pos: dict[int, list[np.ndarray]] = field(default_factory=dict)  # prompt positions of those rows
    k_pos: dict[int, list[np.ndarray]] = field(default_factory=dict)
    nodes_seen: int = 0
    capture_ms: float = 0.0  # time spent in the callback (every node)
    ubatches_stopped: int = 0  # ubatches whose graph stopped right after the last scoring layer
    error: str | None = None

    def tensors(self, layer: int, *others: "Captured") -> tuple[np.ndarray, np.ndarray]:
        """Q and K of every token at `layer`, in prompt order, with the rows `others` (lanes) captured."""
        parts = [self, *others]

        def rows(store: str) -> list[np.ndarray]:
            return [chunk for part in parts for chunk in getattr(part, store).get(layer, [])]

        return _in_order(rows("q"), rows("q_pos")), _in_order(rows("k"), rows("k_pos"))


def _in_order(chunks: list[np.ndarray], positions: list[np.ndarray]) -> np.ndarray:
    """The rows of `chunks` sorted by their prompt positions (lanes capture windows out of order)."""
    rows, where = np.concatenate(chunks), np.concatenate(positions)
    if (np.diff(where) == 1).all():
        return rows
    return rows[np.argsort(where, kind="stable")]


class QKCapture:
    """Builds the C callback for a context; `reset` before each decode, read `result` after.

    Works across ubatches: each ubatch's graph runs up to the last scoring layer's K/Q and stops;
    the layers below it ran fully, so their KV cells are written and the next ubatch attends to
    them as usual. The scoring layer's own KV is never needed: its K comes from the capture.
    """

    def __init__(self, spec: CaptureSpec) -> None:
        if spec.rope not in ("post", "pre"):
            raise ValueError("rope must be 'post' or 'pre'")
        self.spec = spec
        self.last_layer = max(spec.layers)
        self.result = Captured()
        self._wanted: dict[str, tuple[str, int]] = {}
        for layer in spec.layers:
            for kind in "QK":
                self._wanted[f"{kind}cur-{layer}"] = (kind, layer)
                self._wanted[f"{kind}cur_normed-{layer}"] = (kind, layer)
        self._pre: dict[tuple[str, int], np.ndarray] = {}
        self._ubatch_done: set[str] = set()
        self._layout: list[tuple[int, int]] = []
        self.enabled = True  # False: ask for no node (ubatches nobody scores run whole)
        self.callback = C.ggml_backend_sched_eval_callback(self._on_node)

    def reset(self) -> None:
        self.result = Captured()
        self._pre.clear()
        self._ubatch_done.clear()
        self._layout = []
        self.enabled = True

    def layout(self, segments: list[tuple[int, int]]) -> None:
        """Prompt positions of the next ubatches' rows: (first position, rows) per segment, in row
        order (a lane drafts every L-th window); [] for rows that continue the prompt in order."""
        self._layout = list(segments)

    def checkpoint(self) -> dict[tuple[str, int], int]:
        """How many ubatches each capture list holds (to undo an aborted ubatch)."""
        self._pre.clear()
        self._ubatch_done.clear()
        return {(kind, layer): len(chunks) for kind, store in (("q", self.result.q), ("k", self.result.k))
                for layer, chunks in store.items()}

    def rollback(self, kept: dict[tuple[str, int], int]) -> None:
        r = self.result
        for kind, store in (("q", r.q), ("k", r.k), ("q", r.q_pos), ("k", r.k_pos)):
            for layer in list(store):
                del store[layer][kept.get((kind, layer), 0):]
        self._pre.clear()
        self._ubatch_done.clear()

    def _on_node(self, tensor: int, ask: bool, _user: int) -> bool:
        start = time.perf_counter()
        try:
            return self._handle(tensor, ask)
        except Exception as error:  # never unwind through C: record it and stop the graph
            self.result.error = f"{type(error).__name__}: {error}"
            return False
        finally:
            self.result.capture_ms += (time.perf_counter() - start) * 1000.0

    def _handle(self, tensor: int, ask: bool) -> bool:
        target = self._wanted.get(_ggml.ggml_get_name(tensor).decode())
        if ask:
            self.result.nodes_seen += 1
            return self.enabled and target is not None and self._is_head_tensor(tensor, target[0])
        if target is None or not self._is_head_tensor(tensor, target[0]):
            return True
        kind, layer = target
        if _ggml.ggml_op_desc(tensor) != b"ROPE":
            if self.spec.rope == "pre":
                self._pre[target] = _read(tensor)  # the last one before RoPE wins
            return True
        data = _read(tensor) if self.spec.rope == "post" else self._pre.pop(target)
        store, where = (self.result.q, self.result.q_pos) if kind == "Q" else (self.result.k, self.result.k_pos)
        chunks = store.setdefault(layer, [])
        where.setdefault(layer, []).append(self._positions(sum(len(chunk) for chunk in chunks), len(data)))
        chunks.append(data)
        if layer == self.last_layer:
            self._ubatch_done.add(kind)
            if self._ubatch_done == {"Q", "K"}:
                self._ubatch_done.clear()
                self.result.ubatches_stopped += 1
                return False  # nothing after the last scoring layer is needed
        return True

    def _positions(self, seen: int, n: int) -> np.ndarray:
        """Prompt positions of a ubatch's n rows, `seen` rows having come before."""
        if not self._layout:
            return np.arange(seen, seen + n)
        where = np.concatenate([np.arange(pos, pos + count) for pos, count in self._layout])
        if len(where) != n:
            raise ValueError(f"the ubatch layout covers {len(where)} rows, but the captured tensor has {n}")
        return where

    def _is_head_tensor(self, tensor: int, kind: str) -> bool:
        """3-D [head_dim, heads, n_tokens] (not the 2-D matmul output of the same name)."""
        head = _TensorHead.from_address(tensor)
        heads = self.spec.n_head if kind == "Q" else self.spec.n_head_kv
        return head.ne[0] == self.spec.head_dim and head.ne[1] == heads and head.ne[3] == 1


def _read(tensor: int) -> np.ndarray:
    head = _TensorHead.from_address(tensor)
    if not _ggml.ggml_is_contiguous(tensor):
        raise ValueError(f"captured tensor {_ggml.ggml_get_name(tensor).decode()} is not contiguous")
    dtype = {_GGML_TYPE_F32: np.float32, _GGML_TYPE_F16: np.float16}.get(head.type)
    if dtype is None:
        raise ValueError(f"captured tensor has unsupported ggml type {head.type}")
    head_dim, n_head, n_tokens = head.ne[0], head.ne[1], head.ne[2]
    out = np.empty((n_tokens, n_head, head_dim), dtype=dtype)
    _ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, _ggml.ggml_nbytes(tensor))
    return out.astype(np.float32, copy=False)
