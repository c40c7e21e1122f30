"""The drafter: runs a model over a prompt up to its scoring layers, where its scorer turns their Q
and K into one attention mass per prompt token.

By default the drafter is the target model itself (its weights are shared; only the context is
the drafter's own), stopped after the scoring layers. A separate GGUF must share the target's
vocabulary, since scores are per target token.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..llama import Batch, Model
from ..llama.devices import gpu_count
from ..llama.capture import CaptureSpec
from .draft_lane import Cancelled, DraftLane, DrafterError, Job, Tally, never
from .scorers import Scorer, ScoringError, make_scorer
from .pacing import Pacing
from .windows import DraftWindows, Stage

log = logging.getLogger(__name__)

# Architectures with recurrent (state-space) layers: no per-token K to score against.
RECURRENT_ARCHS = {
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1",
    "granitehybrid", "nemotron_h", "plamo2", "lfm2", "qwen3next",
}
# Sliding-window architectures: layer il is global when il % pattern == pattern - 1.
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "cohere2": 4}


@dataclass(frozen=True)
class DraftOptions:
    rope: str = "post"  # score post- or pre-RoPE Q/K
    n_batch: int = 512  # tokens of a window per drafter chunk (and ubatch)
    n_threads: int = 0  # CPU threads (0: llama.cpp's default)
    scorer: str = "auto"  # auto | native | numpy | a pflash_plugin.scorers entry point (scorers.make_scorer)
    device: int = 0  # GPU of the native scorer's captures, when the model's layers are on a GPU
    shared_duty: float = 1.0  # share of time the drafter computes while slots decode (it pauses the rest)
    windows: DraftWindows = DraftWindows()  # one causal pass, or windows beside a sink (linear cost)
    # one KV view for every window ubatch (see draft_lane.DraftLane._pin_view); None: where the layers are on a GPU
    # (on 2 CPU cores one test model drafted 10% slower pinned, another 15% faster: no CPU default)
    pin_window_view: bool | None = None
    lanes: int = 1  # contexts drafting a prompt's windows at once, a thread each (Drafter._draft_in_lanes)


def check_lanes(lanes: int, windows: DraftWindows) -> None:
    """Refuse lanes where there are no windows to share (at start)."""
    if lanes < 1:
        raise ValueError(f"pflash_drafter_lanes must be >= 1, not {lanes}")
    if lanes > 1 and windows.window == 0:
        raise ValueError("pflash_drafter_lanes drafts a prompt's windows on several contexts: it needs "
                         "pflash_drafter_window > 0")


# Lanes where the drafter runs on a GPU: measured on an H200 (docs/pflash_draft_profile.md), a 0.6B drafter's
# windows took 8.7 us a token in one context, 4.7 in 2, 3.8 in 3, 3.2 in 4 and 2.8 in 6 (the host work
# of one lane overlaps the GPU work of another); an 8B target as its own drafter gained no more past 3.
GPU_LANES = 4


def draft_lanes(requested: int | None, on_gpu: bool, windows: DraftWindows,
                fits: Callable[[int], bool] = lambda lanes: True) -> int:
    """Lanes a drafter runs: those requested, else where they pay (windows on a GPU) the most up to
    GPU_LANES whose memory `fits` (each lane is a context: a default must not stop a server that
    starts with one), else one (no windows to share, or a CPU, whose cores one context keeps busy)."""
    if not windows.window:
        return 1
    if requested is not None:
        return requested
    if not on_gpu:
        return 1
    lanes = next((n for n in range(GPU_LANES, 1, -1) if fits(n)), 1)
    if lanes < GPU_LANES:
        log.warning("the drafter drafts in %d lane(s), not %d: more would not leave room for a KV pool of "
                    "max_ctx (set --pflash_drafter_lanes to choose)", lanes, GPU_LANES)
    return lanes


def check_vocab(target: Model, drafter: Model) -> None:
    """Refuse a drafter whose token ids mean something else than the target's."""
    if not target.shares_vocab(drafter):
        raise DrafterError(
            f"the drafter {drafter.path} ({drafter.n_vocab} tokens) does not share the vocabulary of "
            f"the target {target.path} ({target.n_vocab} tokens): use a drafter of the same family"
        )


def scoring_layers(model: Model, requested: list[int] | None) -> list[int]:
    """Requested layers (checked) or the first layer that attends to the whole prompt."""
    arch = model.architecture
    if arch in RECURRENT_ARCHS:
        raise DrafterError(f"architecture {arch} has recurrent layers: PFlash cannot capture attention there")
    pattern = SWA_PATTERNS.get(arch)
    if model.n_swa > 0 and pattern is None and not requested:
        raise DrafterError(
            f"architecture {arch} uses sliding-window attention with an unknown layer pattern: "
            "set --pflash_layers to global-attention layers"
        )
    if requested:
        bad = [layer for layer in requested if not 0 <= layer < model.n_layer]
        if bad:
            raise DrafterError(f"scoring layers {bad} outside 0..{model.n_layer - 1}")
        if pattern and model.n_swa > 0:
            local = [layer for layer in requested if layer % pattern != pattern - 1]
            if local:
                raise DrafterError(f"layers {local} of {arch} are sliding-window layers: "
                                   "they do not see the whole prompt")
        return sorted(set(requested))
    if pattern and model.n_swa > 0:
        return [pattern - 1]
    return [model.n_layer // 3]


@dataclass
class DraftResult:
    mass: np.ndarray  # float64 [query_start]: attention mass of every token before the query
    layers_run: int
    scorer: str  # native-cpu | native-cuda | native-hip | numpy
    windows: int  # 1: one causal pass; more: windowed (see windows.py)
    timings: dict[str, float]  # forward_ms (drafter decode, capture included), capture_ms, score_ms



class Drafter:
    """A prompt's draft: the scorer and its lanes (draft_lane.py: a context each, the lead's first),
    the windows dealt among them, the mass; `run` is called from the compression thread only."""

    def __init__(self, model: Model, layers: list[int], max_tokens: int, options: DraftOptions = DraftOptions(),
                 owns_model: bool = False) -> None:
        if not 0.0 < options.shared_duty <= 1.0:
            raise ValueError(f"shared_duty must be in (0, 1], not {options.shared_duty}")
        self.model, self.layers, self.max_tokens = model, layers, max_tokens
        self.owns_model = owns_model
        self.n_batch, self.windows = options.n_batch, options.windows
        try:
            self.windows.check(self.n_batch, max_tokens)
            check_lanes(options.lanes, self.windows)
        except ValueError as error:
            raise DrafterError(str(error)) from None
        self.scorer = self._scorer(options)  # the lead's, whose mass `run` returns (the lanes' rows count in it)
        self.lanes: list[DraftLane] = []  # more contexts drafting windows at once (options.lanes)
        self._pool: ThreadPoolExecutor | None = None
        self.graph_reuses = 0  # ubatches of the last run that llama.cpp computed on the graph before theirs
        pin = options.pin_window_view
        pin = model.n_gpu_layers != 0 and gpu_count() > 0 if pin is None else pin
        pinned = pin and self.windows.window > 0
        try:
            self.lead = DraftLane(model, self.scorer, self.windows, max_tokens, self.n_batch, options.n_threads,
                                  pinned, lays_out=options.lanes > 1)  # ubatch rows not in prompt order
        except DrafterError:  # the lane closed its context and scorer
            if owns_model:
                model.close()
            raise
        self.duty = options.shared_duty / options.lanes  # each lane's share while slots decode
        try:
            for _ in range(options.lanes - 1):
                self.lanes.append(self._new_lane(options, pinned))
        except DrafterError:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(len(self.lanes), thread_name_prefix="pflash-lane") if self.lanes else None

    def _scorer(self, options: DraftOptions) -> Scorer:
        spec = CaptureSpec(self.layers, self.model.head_dim(), self.model.n_head, self.model.n_head_kv, options.rope)
        try:
            return make_scorer(spec, options.scorer, on_gpu=self.model.n_gpu_layers != 0, device=options.device,
                               n_threads=options.n_threads)
        except ScoringError as error:
            raise DrafterError(str(error)) from None

    def _new_lane(self, options: DraftOptions, pinned: bool) -> DraftLane:
        """Another context (sink + window cells) and scorer on the same model, whose captured rows
        count in this drafter's mass: it drafts every L-th window of a prompt on a thread of its own."""
        lane = DraftLane(self.model, self._scorer(options), replace(self.windows, causal_max=0), self.max_tokens,
                         self.n_batch, options.n_threads, pinned, lays_out=True)  # its windows are every L-th one
        try:
            if not hasattr(lane.scorer, "follow"):
                raise ScoringError(f"the {options.scorer} scorer cannot draft in lanes (pflash_drafter_lanes 1)")
            lane.scorer.follow(self.scorer)
        except ScoringError as error:
            lane.close()
            raise DrafterError(str(error)) from None
        return lane

    def run(
        self,
        tokens: list[int],
        query_start: int,
        query_end: int | None = None,
        should_stop: Callable[[], bool] = never,
        progress: Callable[[int], None] = lambda done: None,
        pacing: Pacing | None = None,
    ) -> DraftResult:
        """Draft `tokens` chunk by chunk and score keys [0, query_start) by the attention of the
        queries [query_start, query_end). Scoring is background work, paced beside the engine's
        slots by `pacing` (pacing.py: polite up to its bound, then as if alone; None: alone); while
        slots decode it computes `shared_duty` of the time."""
        if len(tokens) > self.max_tokens:
            raise DrafterError(f"{len(tokens)} tokens exceed the drafter context ({self.max_tokens})")
        query_end = len(tokens) if query_end is None else query_end
        if not 1 <= query_start < query_end <= len(tokens):
            raise DrafterError(f"query [{query_start}, {query_end}) does not fit {len(tokens)} tokens")
        batch = Batch(self.n_batch, 1)
        reused_before = self.lead.ctx.graph_reuses()
        try:
            self.lead.clear()
            self.scorer.begin(query_start, query_end)
            for lane in self.lanes:  # after the lead's (a lane writes into the lead's stores), every run:
                lane.scorer.begin(query_start, query_end)  # rows of an earlier prompt must not count
            forward_start = time.perf_counter()
            first, *rest = stages = self.windows.stages(query_end)
            job = Job(tokens, should_stop, Tally(progress), (pacing or Pacing()).lane(self.duty))
            if self.lanes and rest:
                self._draft_in_lanes(first, rest, job, batch)
            else:
                self.lead.draft_from_first(first, rest, job, batch)
            forward_ms = (time.perf_counter() - forward_start) * 1000.0
            mass = self.scorer.mass()
        except ScoringError as error:
            raise DrafterError(f"the {self.model.architecture} drafter could not score: {error}") from None
        finally:
            self.lead.clear()
            batch.close()
        self.graph_reuses = self.lead.ctx.graph_reuses() - reused_before
        return DraftResult(mass, max(self.layers) + 1, self.scorer.name, len(stages),
                           {"forward_ms": round(forward_ms, 3), **self.scorer.timings()})

    def _draft_in_lanes(self, first: Stage, windows: list[Stage], job: Job, batch: Batch) -> None:
        """The first stage and the windows dealt round-robin to the lead and the lanes, drafted at
        once: one lane's host work (a ubatch's inputs and graph launch) overlaps another's GPU work,
        which the capture callback's synchronization otherwise serializes. The lead, which also
        drafts the first stage, takes the smallest share. The first failure stops every lane."""
        assert self._pool is not None
        stop = threading.Event()

        def halt() -> bool:
            return stop.is_set() or job.should_stop()

        halting = replace(job, should_stop=halt)
        count = len(self.lanes) + 1
        futures = [self._pool.submit(lane.draft_as_lane, windows[i::count], halting)
                   for i, lane in enumerate(self.lanes) if windows[i::count]]
        for future in futures:
            future.add_done_callback(lambda done: stop.set() if done.exception() else None)
        errors: list[BaseException] = []
        try:
            self.lead.draft_from_first(first, windows[count - 1::count], halting, batch)
        except BaseException as error:  # re-raised below, once the lanes have stopped
            errors.append(error)
            stop.set()
        for future in futures:
            try:
                future.result()
            except BaseException as error:
                errors.append(error)
        if errors:  # a lane's own failure before the Cancelled it caused in the others
            raise next((error for error in errors if not isinstance(error, Cancelled)), errors[0])

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        if self._pool is not None:
            self._pool.shutdown()
        self.lead.close()
        if self.owns_model:
            self.model.close()
