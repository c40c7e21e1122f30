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

from ..llama import Batch, Context, ContextConfig, DecodeError, Model
from ..llama.devices import gpu_count
from ..llama.capture import CaptureSpec
from .scorers import ScoringError, make_scorer
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


KV_VIEW_PAD = 256  # llama.cpp rounds the cells a ubatch attends to (n_kv) up to a multiple of this
PIN_SEQ = 1  # the sequence of the cell that pins a windowed draft's KV view (Drafter._pin_view)


def _never() -> bool:
    return False


@dataclass(frozen=True)
class DraftOptions:
    rope: str = "post"  # score post- or pre-RoPE Q/K
    n_batch: int = 512  # tokens of a window per drafter chunk (and ubatch)
    n_threads: int = 0  # CPU threads (0: llama.cpp's default)
    scorer: str = "auto"  # auto | native | numpy | a pflash_plugin.scorers entry point (scorers.make_scorer)
    device: int = 0  # GPU of the native scorer's captures, when the model's layers are on a GPU
    shared_duty: float = 1.0  # share of time the drafter computes while slots decode (it pauses the rest)
    windows: DraftWindows = DraftWindows()  # one causal pass, or windows beside a sink (linear cost)
    # one KV view for every window ubatch (see Drafter._pin_view); None: where the layers are on a GPU
    # (on 2 CPU cores one test model drafted 10% slower pinned, another 15% faster: no CPU default)
    pin_window_view: bool | None = None
    lanes: int = 1  # contexts drafting a prompt's windows at once, a thread each (Drafter._draft_in_lanes)


class DrafterError(RuntimeError):
    """The drafter cannot score (bad configuration or capture failure)."""


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


class _Tally:
    """Tokens drafted so far, over every lane, for `progress` (lanes add from their threads)."""

    def __init__(self, progress: Callable[[int], None]) -> None:
        self.progress, self.done, self.lock = progress, 0, threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            done = self.done
        self.progress(done)


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class _Job:
    """One prompt's draft, as each of its stages needs it: the tokens, when to stop, the tally of
    tokens drafted (over every lane), the pacing beside the engine's slots."""

    tokens: list[int]
    should_stop: Callable[[], bool]
    tally: _Tally
    pacing: Pacing

    def step_aside(self) -> None:
        """Wait while the pacing says so (requests wait for a first token, within the bound)."""
        while self.pacing.stepping_aside():
            if self.should_stop():
                raise Cancelled()
            time.sleep(0.005)
        if self.should_stop():
            raise Cancelled()


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
    """Owns the drafter context and its scorer; `run` is called from the compression thread only."""

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
        n_threads = options.n_threads
        spec = CaptureSpec(layers, model.head_dim(), model.n_head, model.n_head_kv, options.rope)
        try:
            self.scorer = make_scorer(spec, options.scorer, on_gpu=model.n_gpu_layers != 0, device=options.device,
                                      n_threads=n_threads)
        except ScoringError as error:
            raise DrafterError(str(error)) from None
        self._abort_if: Callable[[], bool] = _never
        self.lanes: list[Drafter] = []  # more contexts drafting windows at once (options.lanes)
        self._pool: ThreadPoolExecutor | None = None
        self.aborted_chunks = 0  # chunks aborted for interactive work and redone
        self.graph_reuses = 0  # ubatches of the last run that llama.cpp computed on the graph before theirs
        pin = options.pin_window_view
        pin = model.n_gpu_layers != 0 and gpu_count() > 0 if pin is None else pin
        self.pinned = pin and self.windows.window > 0
        self.ctx = self._open_context(n_threads)
        self.ctx.set_abort(lambda: self._abort_if())
        if self.windows.window and self.windows.sink and not self.ctx.can_shift:
            self.close()
            raise DrafterError(
                f"windowed drafting with a sink moves the sink's last cell next to each window, and the "
                f"{model.architecture} KV cache cannot shift positions: set pflash_drafter_sink 0 or "
                "pflash_drafter_window 0"
            )
        if self.pinned:
            self._pin_view()
        self.lays_out = options.lanes > 1  # ubatch rows not in prompt order
        self.duty = options.shared_duty / options.lanes  # each lane's share while slots decode
        try:
            for _ in range(options.lanes - 1):
                self.lanes.append(self._new_lane(options))
        except DrafterError:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(len(self.lanes), thread_name_prefix="pflash-lane") if self.lanes else None

    def _open_context(self, n_threads: int) -> Context:
        """The drafter's llama.cpp context, the scorer's capture as its eval callback. swa_full: with
        the trimmed SWA cache, a ubatch's first tokens lose part of their window (measured: K at layer
        5 of gemma-3-270m off by 10% after 2 ubatches); full is exact. The pin (see _pin_view) is a
        cell of a sequence of its own."""
        n_seqs = 1 + int(self.pinned)
        return Context(
            self.model,
            ContextConfig(
                n_ctx=self.windows.context_tokens(self.max_tokens) + int(self.pinned),
                n_batch=self.n_batch,
                n_ubatch=self.n_batch,
                n_seq_max=n_seqs,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                swa_full=True,
                flash_attn=True,
                n_outputs_max=n_seqs,  # the drafter reads no logits (llama.cpp reserves a row per sequence)
            ),
            eval_callback=self.scorer.callback,
            eval_callback_data=self.scorer.callback_data,
        )

    def _new_lane(self, options: DraftOptions) -> Drafter:
        """Another context (sink + window cells) and scorer on the same model, whose captured rows
        count in this drafter's mass: it drafts every L-th window of a prompt on a thread of its own."""
        lane = Drafter(self.model, self.layers, self.max_tokens,
                       replace(options, windows=replace(self.windows, causal_max=0), lanes=1, shared_duty=self.duty))
        try:
            if not hasattr(lane.scorer, "follow"):
                raise ScoringError(f"the {options.scorer} scorer cannot draft in lanes (pflash_drafter_lanes 1)")
            lane.scorer.follow(self.scorer)
        except ScoringError as error:
            lane.close()
            raise DrafterError(str(error)) from None
        lane.lays_out = True  # its windows are every L-th one
        return lane

    def run(
        self,
        tokens: list[int],
        query_start: int,
        query_end: int | None = None,
        should_stop: Callable[[], bool] = _never,
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
        reused_before = self.ctx.graph_reuses()
        try:
            self._clear()
            self.scorer.begin(query_start, query_end)
            for lane in self.lanes:  # after the lead's (a lane writes into the lead's stores), every run:
                lane.scorer.begin(query_start, query_end)  # rows of an earlier prompt must not count
            forward_start = time.perf_counter()
            first, *rest = stages = self.windows.stages(query_end)
            job = _Job(tokens, should_stop, _Tally(progress), (pacing or Pacing()).lane(self.duty))
            if self.lanes and rest:
                self._draft_in_lanes(first, rest, job, batch)
            else:
                self._draft_from_first(first, rest, job, batch)
            forward_ms = (time.perf_counter() - forward_start) * 1000.0
            mass = self.scorer.mass()
        except ScoringError as error:
            raise DrafterError(f"the {self.model.architecture} drafter could not score: {error}") from None
        finally:
            self._clear()
            batch.close()
        self.graph_reuses = self.ctx.graph_reuses() - reused_before
        return DraftResult(mass, max(self.layers) + 1, self.scorer.name, len(stages),
                           {"forward_ms": round(forward_ms, 3), **self.scorer.timings()})

    def _pin_view(self) -> None:
        """Keep a cell of sequence 1 at the last cell a window needs. llama.cpp sizes each ubatch's
        view of the KV (n_kv) by the highest cell in use, so a window's ubatches would each see a
        larger view than the one before; with the pin every window ubatch has the same shapes, and
        llama.cpp reuses the previous ubatch's graph instead of building one (but after the K shift
        that starts each window), which on a GPU the CUDA backend replays as CUDA graphs instead of
        launching ~270 kernels one by one (the launches were most of a 512-token draft ubatch's time
        on an H200: docs/pflash_draft_profile.md). The drafting sequence is masked from the pin, which
        is placed by decoding that many positions into the empty cache, whose cells fill in order, and
        dropping all but the last."""
        cells = -(-(self.windows.sink + self.windows.window + 1) // KV_VIEW_PAD) * KV_VIEW_PAD
        batch = Batch(self.n_batch, 1)
        try:  # before any scorer.begin: the capture keeps nothing of these ubatches
            for start in range(0, cells, self.n_batch):
                batch.clear()
                batch.add_sequence([0] * min(self.n_batch, cells - start), start, PIN_SEQ, False)
                self.ctx.decode(batch)
        finally:
            batch.close()
        self.ctx.seq_rm(PIN_SEQ, 0, cells - 1)

    def _clear(self) -> None:
        """Empty the drafting sequences (but the pin)."""
        if self.pinned:
            self.ctx.seq_rm(0)
        else:
            self.ctx.clear()

    def _draft_in_lanes(self, first: Stage, windows: list[Stage], job: _Job, batch: Batch) -> None:
        """The first stage and the windows dealt round-robin to this drafter and its lanes, drafted at
        once: one lane's host work (a ubatch's inputs and graph launch) overlaps another's GPU work,
        which the capture callback's synchronization otherwise serializes. This drafter, which also
        drafts the first stage, takes the smallest share. The first failure stops every lane."""
        assert self._pool is not None
        stop = threading.Event()

        def halt() -> bool:
            return stop.is_set() or job.should_stop()

        halting = replace(job, should_stop=halt)
        count = len(self.lanes) + 1
        futures = [self._pool.submit(lane._draft_as_lane, windows[i::count], halting)
                   for i, lane in enumerate(self.lanes) if windows[i::count]]
        for future in futures:
            future.add_done_callback(lambda done: stop.set() if done.exception() else None)
        errors: list[BaseException] = []
        try:
            self._draft_from_first(first, windows[count - 1::count], halting, batch)
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

    def _draft_from_first(self, first: Stage, windows: list[Stage], job: _Job, batch: Batch) -> None:
        """The first stage (the sink and a first window), then `windows` beside the sink."""
        self._draft_stage(first, job, batch)
        self._draft_windows(windows, min(self.windows.sink, first.end) - 1, job, batch)

    def _draft_as_lane(self, windows: list[Stage], job: _Job) -> None:
        """A lane's part of a prompt (its scorer begun with the lead's): the sink again, which the lead
        captured, then its windows."""
        batch = Batch(self.n_batch, 1)
        try:
            self._clear()
            sink = min(self.windows.sink, windows[0].start)
            self.scorer.enable(False)
            for start in range(0, sink, self.n_batch):
                batch.clear()
                batch.add_sequence(job.tokens[start:min(sink, start + self.n_batch)], start, 0, False)
                self._decode_politely(batch, job)
            self.scorer.enable(True)
            self._draft_windows(windows, sink - 1, job, batch)
        finally:
            self._clear()
            batch.close()

    def _draft_windows(self, windows: list[Stage], bridge: int, job: _Job, batch: Batch) -> None:
        """The windows one after another, each beside the sink whose last cell is `bridge`."""
        for stage in windows:
            bridge = self._enter_window(stage, bridge)
            self._draft_stage(stage, job, batch)

    def _enter_window(self, stage: Stage, bridge: int) -> int:
        """Drop the previous window's cells, keeping the sink, and move the sink's last cell to just
        before this window: llama.cpp wants each sequence to continue at its last position + 1, and
        a cell of the previous window there would carry that window into this one."""
        self.ctx.seq_rm(0, bridge + 1, -1)
        if bridge < 0:
            return -1  # no sink: the sequence is empty, and may start anywhere
        self.ctx.seq_add(0, bridge, bridge + 1, stage.start - 1 - bridge)
        return stage.start - 1

    def _draft_stage(self, stage: Stage, job: _Job, batch: Batch) -> None:
        """Decode a stage chunk by chunk and politely (see `run`), telling the scorer the chunk's prompt
        positions where its rows are not in prompt order (lanes)."""
        done = stage.start
        while done < stage.end:
            job.step_aside()  # then the turn: it may have changed meanwhile
            turn = job.pacing.turn()
            end = min(done + min(self.n_batch, turn.chunk or self.n_batch), stage.end)
            batch.clear()
            batch.add_sequence(job.tokens[done:end], done, 0, False)
            if self.lays_out:
                self.scorer.layout([(done, end - done)])
            chunk_start = time.perf_counter()
            self._decode_politely(batch, job)
            if self.scorer.error():
                raise DrafterError(f"capture failed: {self.scorer.error()}")
            if turn.duty < 1.0:
                time.sleep((time.perf_counter() - chunk_start) * (1.0 / turn.duty - 1.0))
            job.tally.add(end - done)
            done = end

    def _decode_politely(self, batch: Batch, job: _Job) -> None:
        """Decode one chunk, stepping aside first (and aborting it in flight) while the pacing says so."""
        while True:
            job.step_aside()
            self.scorer.checkpoint()
            self._abort_if = job.pacing.stepping_aside
            try:
                self.ctx.decode(batch)
                return
            except DecodeError as error:
                if error.code != 2:
                    raise DrafterError(str(error)) from None
                self.scorer.rollback()  # aborted for interactive work: llama.cpp dropped the chunk
                self.aborted_chunks += 1
            finally:
                self._abort_if = _never

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        if self._pool is not None:
            self._pool.shutdown()
        self.ctx.close()
        self.scorer.close()
        if self.owns_model:
            self.model.close()
