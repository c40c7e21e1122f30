"""Scorers: what a drafter's eval callback keeps, and how it becomes one attention mass per token.

`native` (ggml_ext/, through llama/native.py) picks the Q/K nodes in C, keeps them where they were
computed (host or GPU) and scores there; `numpy` captures in Python and scores with
`attention_mass.attention_mass`. Both give the mass that the query rows pay every earlier token.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from .. import plugins
from ..llama import native
from ..llama.capture import CaptureSpec, QKCapture
from .attention_mass import NonFiniteScores, attention_mass, combine_layers


class ScoringError(RuntimeError):
    """The scorer cannot give a mass (capture incomplete, device error)."""


class Scorer(Protocol):
    name: str  # native-cpu | native-cuda | native-hip | numpy
    callback: Any  # the context's eval callback and its user data
    callback_data: Any

    def begin(self, query_start: int, query_end: int) -> None: ...
    # prompt positions of the next ubatches' rows as (first, count) segments when they do not follow
    # the rows before (a lane's windows); [] (and begin): in order. Optional, for lanes.
    def layout(self, segments: list[tuple[int, int]]) -> None: ...
    # Optional, for drafting lanes (DraftOptions.lanes): this scorer's rows count in `lead`'s mass;
    # enable(False) captures nothing until the next begin.
    def follow(self, lead: "Scorer") -> None: ...
    def enable(self, enabled: bool) -> None: ...
    def checkpoint(self) -> None: ...
    def rollback(self) -> None: ...
    def error(self) -> str | None: ...
    def ubatches_stopped(self) -> int: ...
    def mass(self) -> np.ndarray: ...
    def timings(self) -> dict[str, float]: ...
    def tensors(self, layer: int) -> tuple[np.ndarray, np.ndarray]: ...
    def close(self) -> None: ...


class NumpyScorer:
    """The Python eval callback of llama/capture.py, scored with numpy on the host."""

    name = "numpy"

    def __init__(self, spec: CaptureSpec) -> None:
        self.spec = spec
        self.capture = QKCapture(spec)
        self.callback, self.callback_data = self.capture.callback, None
        self._kept: dict = {}
        self._query = (0, 0)
        self._score_ms = 0.0
        self._lanes: list[NumpyScorer] = []

    def begin(self, query_start: int, query_end: int) -> None:
        self.capture.reset()
        self._query = (query_start, query_end)

    def layout(self, segments: list[tuple[int, int]]) -> None:
        self.capture.layout(segments)

    def follow(self, lead: Scorer) -> None:
        if not isinstance(lead, NumpyScorer):
            raise ScoringError("a numpy lane follows a numpy scorer")
        lead._lanes.append(self)

    def enable(self, enabled: bool) -> None:
        self.capture.enabled = enabled

    def checkpoint(self) -> None:
        self._kept = self.capture.checkpoint()

    def rollback(self) -> None:
        self.capture.rollback(self._kept)

    def error(self) -> str | None:
        return self.capture.result.error

    def ubatches_stopped(self) -> int:
        return self.capture.result.ubatches_stopped

    def _full(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        result = self.capture.result
        if layer not in result.q or layer not in result.k:
            raise ScoringError(f"the graph exposed no Qcur/Kcur nodes at layer {layer}")
        q, k = result.tensors(layer, *(lane.capture.result for lane in self._lanes))
        if len(q) < self._query[1] or len(k) < self._query[1]:
            raise ScoringError("captured Q/K do not cover every prompt token")
        return q, k

    def mass(self) -> np.ndarray:
        start = time.perf_counter()
        masses = []
        for layer in self.spec.layers:
            q, k = self._full(layer)
            masses.append(attention_mass(q, k, *self._query))
        mass = combine_layers(masses)
        self._score_ms = (time.perf_counter() - start) * 1000.0
        return mass

    def timings(self) -> dict[str, float]:
        return {"capture_ms": round(self.capture.result.capture_ms, 3), "score_ms": round(self._score_ms, 3)}

    def tensors(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Q of the query rows and K of the keys before them, as the native scorer keeps them."""
        q, k = self._full(layer)
        start, end = self._query
        return q[start:end], k[:start]

    def close(self) -> None:
        pass


class NativeScorer:
    """ggml_ext's C callback; captures stay on the device that computed them."""

    def __init__(self, spec: CaptureSpec, on_gpu: bool, device: int, n_threads: int) -> None:
        self.spec = spec
        self.capture = native.NativeCapture(spec, on_gpu, device, n_threads)
        self.name = self.capture.backend
        self.callback, self.callback_data = self.capture.callback, self.capture.callback_data

    def begin(self, query_start: int, query_end: int) -> None:
        try:
            self.capture.reset(query_start, query_end)
        except native.NativeError as error:
            raise ScoringError(str(error)) from None

    def layout(self, segments: list[tuple[int, int]]) -> None:
        try:
            self.capture.layout(segments)
        except native.NativeError as error:
            raise ScoringError(str(error)) from None

    def follow(self, lead: Scorer) -> None:
        if not isinstance(lead, NativeScorer):
            raise ScoringError("a native lane follows a native scorer")
        try:
            self.capture.follow(lead.capture)
        except native.NativeError as error:
            raise ScoringError(str(error)) from None

    def enable(self, enabled: bool) -> None:
        self.capture.enable(enabled)

    def checkpoint(self) -> None:
        self.capture.checkpoint()

    def rollback(self) -> None:
        self.capture.rollback()

    def error(self) -> str | None:
        return self.capture.error

    def ubatches_stopped(self) -> int:
        return int(self.capture.stats()["ubatches_stopped"])

    def mass(self) -> np.ndarray:
        try:
            return self.capture.score().astype(np.float64)
        except native.NativeError as error:
            if error.non_finite:
                raise NonFiniteScores(str(error)) from None
            raise ScoringError(str(error)) from None

    def timings(self) -> dict[str, float]:
        stats = self.capture.stats()
        return {"capture_ms": round(stats["capture_ms"], 3), "score_ms": round(stats["score_ms"], 3)}

    def tensors(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        index = sorted(self.spec.layers).index(layer)
        return self.capture.read(index, "Q"), self.capture.read(index, "K")

    def close(self) -> None:
        self.capture.close()


def auto_scorer(spec: CaptureSpec, on_gpu: bool = False, device: int = 0, n_threads: int = 0) -> Scorer:
    """Native when the library is built, else numpy."""
    if native.load() is None:
        return NumpyScorer(spec)
    return NativeScorer(spec, on_gpu, device, n_threads)


def native_scorer(spec: CaptureSpec, on_gpu: bool = False, device: int = 0, n_threads: int = 0) -> Scorer:
    if native.load() is None:
        raise ScoringError("the native scorer is not built: reinstall pflash-plugin with a C++ compiler "
                           "(pip install -e . builds ggml_ext/), or use the numpy scorer")
    return NativeScorer(spec, on_gpu, device, n_threads)


def numpy_scorer(spec: CaptureSpec, on_gpu: bool = False, device: int = 0, n_threads: int = 0) -> Scorer:
    return NumpyScorer(spec)


def make_scorer(spec: CaptureSpec, choice: str = "auto", on_gpu: bool = False, device: int = 0,
                n_threads: int = 0) -> Scorer:
    """The scorer factory of that name in the `pflash_plugin.scorers` group (the built-ins above, or a
    plugin's), called as factory(spec, on_gpu=, device=, n_threads=) and returning a `Scorer`."""
    try:
        factory = plugins.scorer(choice)
    except ValueError as error:
        raise ScoringError(str(error)) from None
    return factory(spec, on_gpu=on_gpu, device=device, n_threads=n_threads)
