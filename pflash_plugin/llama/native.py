"""ctypes binding of the native library (ggml_ext/, built by `pip install` as pflash_plugin/_pflash_ext*.so):
the PFlash scorer and the host's batch sampler.

The library's eval callback replaces the Python one of `capture.py`: it picks the scoring layers'
Q/K nodes in C, keeps them where they were computed (host or GPU) and returns only one attention
mass per prompt token. `sample_rows` samples a step's rows in parallel (engine/batch_sampling.py).
`load()` is None when the library was not built or PFLASH_NATIVE=0.
"""
from __future__ import annotations

import ctypes
import functools
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import numpy as np
import llama_cpp  # noqa: F401  (loads libggml-base under its SONAME before the extension binds to it)
import llama_cpp.llama_cpp as C

from .capture import CaptureSpec
from .held import holding_gil

_PACKAGE = Path(__file__).resolve().parent.parent


class NativeError(RuntimeError):
    """The native scorer failed; `non_finite` when a logit or a mass was NaN/Inf."""

    def __init__(self, message: str, non_finite: bool = False) -> None:
        super().__init__(message)
        self.non_finite = non_finite


class _Stats(ctypes.Structure):
    _fields_ = [("nodes_seen", ctypes.c_int64), ("ubatches_stopped", ctypes.c_int64),
                ("capture_ms", ctypes.c_double), ("score_ms", ctypes.c_double)]


def _library_path() -> Path | None:
    for suffix in EXTENSION_SUFFIXES:
        path = _PACKAGE / f"_pflash_ext{suffix}"
        if path.exists():
            return path
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The native library, or None (not built, or disabled with PFLASH_NATIVE=0)."""
    path = _library_path()
    if os.environ.get("PFLASH_NATIVE", "1") == "0" or path is None:
        return None
    lib = ctypes.CDLL(str(path))
    p, i32, f32p = ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_float)
    signatures = {
        "pfx_build_backend": ([], ctypes.c_char_p),
        "pfx_gpu_count": ([], ctypes.c_int),
        "pfx_capture_new": ([ctypes.POINTER(i32), i32, i32, i32, i32, ctypes.c_bool, ctypes.c_bool, i32, i32], p),
        "pfx_capture_free": ([p], None),
        "pfx_capture_on_gpu": ([p], ctypes.c_bool),
        "pfx_capture_reset": ([p, i32, i32], ctypes.c_bool),
        "pfx_capture_layout": ([p, ctypes.POINTER(i32), ctypes.POINTER(i32), i32], ctypes.c_bool),
        "pfx_capture_follow": ([p, p], ctypes.c_bool),
        "pfx_capture_enable": ([p, ctypes.c_bool], None),
        "pfx_capture_checkpoint": ([p], None),
        "pfx_capture_rollback": ([p], None),
        "pfx_capture_error": ([p], ctypes.c_char_p),
        "pfx_capture_get_stats": ([p, ctypes.POINTER(_Stats)], None),
        "pfx_capture_score": ([p, f32p], ctypes.c_int),
        "pfx_capture_read": ([p, i32, ctypes.c_char, f32p], ctypes.c_bool),
        "pfx_attention_mass": ([f32p, f32p, i32, i32, i32, i32, i32, i32, ctypes.c_bool, i32, f32p], ctypes.c_int),
        "pfx_sample_rows": ([f32p, ctypes.c_int64, p, i32, ctypes.POINTER(i32), i32], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    bitmask = getattr(lib, "pfx_apply_bitmask", None)  # absent from a library built before it
    if bitmask is not None:
        bitmask.argtypes = [f32p, ctypes.c_int64, p, p, ctypes.c_int64, p, i32, i32]
        bitmask.restype = i32
    return lib


def backend_name(on_gpu: bool) -> str | None:
    """'native-cpu', 'native-cuda' or 'native-hip' for captures kept on that side, None without the library."""
    lib = load()
    if lib is None:
        return None
    return f"native-{lib.pfx_build_backend().decode()}" if on_gpu else "native-cpu"


def gpu_count() -> int:
    lib = load()
    return lib.pfx_gpu_count() if lib is not None else 0


# pfx_sample_row (pflash_ext.h), one row of a step to sample on the host
SAMPLE_ROW = np.dtype([("row", np.int64), ("uniform", np.float64), ("temperature", np.float32),
                       ("top_p", np.float32), ("min_p", np.float32), ("top_k", np.int32)])
assert SAMPLE_ROW.itemsize == 32, "SAMPLE_ROW must match pfx_sample_row"


@functools.cache
def held(name: str) -> Any:
    """The library's function `name` keeping the GIL through the call (llama/held.py; None where the
    library or the function is not there): the sampler and the grammar masks, which the engine
    thread calls every step between the logits and the next launch, and whose threads are OpenMP's,
    needing no GIL. Released, the engine thread waited to take the GIL back after each such call
    whenever another thread ran Python: 64 greedy rows of a 128K vocabulary beside a busy Python
    thread on 2 shared CPU cores, 83.3 ms a step released against 70.7 held (bench/engine_gil.py)."""
    lib = load()
    fn = getattr(lib, name, None) if lib is not None else None
    return None if fn is None else holding_gil(fn)


def sample_rows(logits: np.ndarray, rows: np.ndarray, n_threads: int) -> np.ndarray | None:
    """Each of `rows`' token (SAMPLE_ROW entries into float32 `logits` [*, n_vocab]), -1 where the
    row's max is not finite or (greedy) is NaN; None without the library."""
    lib = load()
    if lib is None:
        return None
    if logits.dtype != np.float32 or logits.ndim != 2 or not logits.flags.c_contiguous or rows.dtype != SAMPLE_ROW:
        raise ValueError("sample_rows wants C-contiguous float32 logits [rows, n_vocab] and SAMPLE_ROW rows")
    if rows.size and not (0 <= rows["row"].min() and rows["row"].max() < logits.shape[0]):
        raise ValueError("a row index is outside the logits")
    rows = np.ascontiguousarray(rows)
    tokens = np.empty(rows.size, dtype=np.int32)
    status = held("pfx_sample_rows")(_floats(logits), logits.shape[1], rows.ctypes.data, rows.size,
                                     tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n_threads)
    if status != 0:
        raise NativeError(f"native sampling failed ({status})")
    return tokens


def apply_bitmask(logits: np.ndarray, rows: np.ndarray, masks: np.ndarray, mask_rows: np.ndarray,
                  n_threads: int) -> bool:
    """-inf in each of `rows` of float32 `logits` [*, n_vocab] wherever its mask (row `mask_rows[r]`
    of int32 `masks` [*, words], llguidance's bitmasks) has a 0 bit; False without the library (or
    a library built before it), where the caller applies them itself."""
    fn = held("pfx_apply_bitmask")
    if fn is None:
        return False
    if logits.dtype != np.float32 or logits.ndim != 2 or not logits.flags.c_contiguous or masks.dtype != np.int32 \
            or not masks.flags.c_contiguous or rows.shape != mask_rows.shape:
        raise ValueError("apply_bitmask wants C-contiguous float32 logits and int32 masks, a mask row per row")
    if rows.size and not (0 <= rows.min() and rows.max() < logits.shape[0]
                          and 0 <= mask_rows.min() and mask_rows.max() < masks.shape[0]):
        raise ValueError("a row index is outside the logits or the masks")
    rows, mask_rows = np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(mask_rows, dtype=np.int64)
    status = fn(_floats(logits), logits.shape[1], rows.ctypes.data, masks.ctypes.data, masks.shape[1],
                mask_rows.ctypes.data, rows.size, n_threads)
    if status != 0:
        raise NativeError(f"native masking failed ({status})")
    return True


def _floats(array: np.ndarray) -> ctypes._Pointer[ctypes.c_float]:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def _check(status: int, message: str) -> None:
    if status == 1:
        raise NativeError("a logit or an attention mass is not finite", non_finite=True)
    if status != 0:
        raise NativeError(message or f"native scoring failed ({status})")


class NativeCapture:
    """A capture object for one drafter context: pass `callback` and `callback_data` to Context."""

    def __init__(self, spec: CaptureSpec, use_gpu: bool, device: int = 0, n_threads: int = 0) -> None:
        lib = load()
        if lib is None:
            raise NativeError("the native scorer is not built")
        self._lib, self.spec = lib, spec
        layers = (ctypes.c_int32 * len(spec.layers))(*sorted(spec.layers))
        self._ptr = lib.pfx_capture_new(layers, len(spec.layers), spec.head_dim, spec.n_head, spec.n_head_kv,
                                        spec.rope == "pre", use_gpu, device, n_threads)
        if not self._ptr:
            raise NativeError(f"invalid capture shape {spec}")
        self.on_gpu: bool = lib.pfx_capture_on_gpu(self._ptr)
        address = ctypes.cast(lib.pfx_eval_callback, ctypes.c_void_p).value
        assert address is not None, "the native library exports no eval callback"
        self.callback = C.ggml_backend_sched_eval_callback(address)
        self.callback_data = ctypes.c_void_p(self._ptr)
        self.query_start = self.query_end = 0

    @property
    def backend(self) -> str:
        name = backend_name(self.on_gpu)
        assert name is not None
        return name

    def reset(self, query_start: int, query_end: int) -> None:
        self.query_start, self.query_end = query_start, query_end
        if not self._lib.pfx_capture_reset(self._ptr, query_start, query_end):
            raise NativeError(self.error or "could not allocate the capture")

    def layout(self, segments: list[tuple[int, int]]) -> None:
        """Prompt positions of the next ubatches' rows: (first position, rows) per segment, in row
        order; [] for rows that continue the prompt in order."""
        positions = (ctypes.c_int32 * len(segments))(*(pos for pos, _ in segments))
        counts = (ctypes.c_int32 * len(segments))(*(n for _, n in segments))
        if not self._lib.pfx_capture_layout(self._ptr, positions, counts, len(segments)):
            raise NativeError(self.error or f"invalid ubatch layout {segments}")

    def follow(self, lead: "NativeCapture") -> None:
        """Write this capture's rows into `lead`'s stores (a drafter lane; see pflash_ext.h)."""
        if not self._lib.pfx_capture_follow(self._ptr, lead._ptr):
            raise NativeError(self.error or "this capture cannot follow that one")

    def enable(self, enabled: bool) -> None:
        """False: capture nothing, and let ubatches run whole (reset enables again)."""
        self._lib.pfx_capture_enable(self._ptr, enabled)

    def checkpoint(self) -> None:
        self._lib.pfx_capture_checkpoint(self._ptr)

    def rollback(self) -> None:
        self._lib.pfx_capture_rollback(self._ptr)

    @property
    def error(self) -> str | None:
        return self._lib.pfx_capture_error(self._ptr).decode() or None

    def stats(self) -> dict:
        out = _Stats()
        self._lib.pfx_capture_get_stats(self._ptr, ctypes.byref(out))
        return {field[0]: getattr(out, field[0]) for field in _Stats._fields_}

    def score(self) -> np.ndarray:
        """Attention mass of keys [0, query_start), max over the scoring layers."""
        out = np.empty(self.query_start, dtype=np.float32)
        _check(self._lib.pfx_capture_score(self._ptr, _floats(out)), self.error or "")
        return out

    def read(self, index: int, kind: str) -> np.ndarray:
        """Captured K (keys before the query) or Q (the query rows) of scoring-layer `index`."""
        s = self.spec
        rows, heads = (self.query_start, s.n_head_kv) if kind == "K" else (self.query_end - self.query_start, s.n_head)
        out = np.empty((rows, heads, s.head_dim), dtype=np.float32)
        if not self._lib.pfx_capture_read(self._ptr, index, kind.encode(), _floats(out)):
            raise NativeError(self.error or f"cannot read {kind} of scoring layer {index}")
        return out

    def close(self) -> None:
        if self._ptr:
            self._lib.pfx_capture_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()


def attention_mass(q: np.ndarray, k: np.ndarray, query_start: int, query_end: int, use_gpu: bool = False,
                   n_threads: int = 0) -> np.ndarray:
    """The native kernel on host arrays q [n, n_head, head_dim] and k [n, n_head_kv, head_dim]."""
    lib = load()
    if lib is None:
        raise NativeError("the native scorer is not built")
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = np.ascontiguousarray(k, dtype=np.float32)
    (n, n_head, head_dim), n_head_kv = q.shape, k.shape[1]
    out = np.empty(query_start, dtype=np.float32)
    status = lib.pfx_attention_mass(_floats(q), _floats(k), n, n_head, n_head_kv, head_dim, query_start, query_end,
                                    use_gpu, n_threads, _floats(out))
    _check(status, "invalid attention shape")
    return out
