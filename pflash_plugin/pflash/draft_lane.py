"""A drafter lane: one llama.cpp context and its scorer, decoding a prompt's stages chunk by chunk
beside the engine's slots.

Why apart from drafter.py: the Drafter decides what a draft is (its scorer, its windows, how many
lanes, the result); a lane is the mechanism that drafts stages on one context, the same for the
lead (which also drafts the first stage) and each lane beside it (drafter.Drafter._draft_in_lanes).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..llama import Batch, Context, ContextConfig, DecodeError, Model
from .pacing import Pacing
from .scorers import Scorer
from .windows import DraftWindows, Stage

KV_VIEW_PAD = 256  # llama.cpp rounds the cells a ubatch attends to (n_kv) up to a multiple of this
PIN_SEQ = 1  # the sequence of the cell that pins a windowed draft's KV view (DraftLane._pin_view)


def never() -> bool:
    return False


class DrafterError(RuntimeError):
    """The drafter cannot score (bad configuration or capture failure)."""


class Cancelled(Exception):
    pass


class Tally:
    """Tokens drafted so far, over every lane, for `progress` (lanes add from their threads)."""

    def __init__(self, progress: Callable[[int], None]) -> None:
        self.progress, self.done, self.lock = progress, 0, threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            done = self.done
        self.progress(done)


@dataclass(frozen=True)
class Job:
    """One prompt's draft, as each of its stages needs it: the tokens, when to stop, the tally of
    tokens drafted (over every lane), the pacing beside the engine's slots."""

    tokens: list[int]
    should_stop: Callable[[], bool]
    tally: Tally
    pacing: Pacing

    def step_aside(self) -> None:
        """Wait while the pacing says so (requests wait for a first token, within the bound)."""
        while self.pacing.stepping_aside():
            if self.should_stop():
                raise Cancelled()
            time.sleep(0.005)
        if self.should_stop():
            raise Cancelled()


class DraftLane:
    """A context of the drafter's model and the scorer capturing it (the lane owns both): drafts the
    stages it is given, stepping aside (and aborting a chunk in flight) while the pacing says so."""

    def __init__(self, model: Model, scorer: Scorer, windows: DraftWindows, max_tokens: int, n_batch: int,
                 n_threads: int, pinned: bool, lays_out: bool) -> None:
        """`windows`: the stages' shape, which sizes the context (sink + window cells for a lane that
        drafts no causal pass); `pinned`: keep the KV view pinned (_pin_view); `lays_out`: its
        ubatch rows are not in prompt order (drafting in lanes), so the scorer is told their positions."""
        self.model, self.scorer, self.windows = model, scorer, windows
        self.n_batch, self.pinned, self.lays_out = n_batch, pinned, lays_out
        self._abort_if: Callable[[], bool] = never
        self.aborted_chunks = 0  # chunks aborted for interactive work and redone
        self.ctx = self._open_context(max_tokens, n_threads)
        self.ctx.set_abort(lambda: self._abort_if())
        if windows.window and windows.sink and not self.ctx.memory.can_shift:
            self.close()
            raise DrafterError(
                f"windowed drafting with a sink moves the sink's last cell next to each window, and the "
                f"{model.architecture} KV cache cannot shift positions: set pflash_drafter_sink 0 or "
                "pflash_drafter_window 0"
            )
        if pinned:
            self._pin_view()

    def _open_context(self, max_tokens: int, n_threads: int) -> Context:
        """The lane's llama.cpp context, the scorer's capture as its eval callback. swa_full: with
        the trimmed SWA cache, a ubatch's first tokens lose part of their window (measured: K at layer
        5 of gemma-3-270m off by 10% after 2 ubatches); full is exact. The pin (see _pin_view) is a
        cell of a sequence of its own."""
        n_seqs = 1 + int(self.pinned)
        return Context(
            self.model,
            ContextConfig(
                n_ctx=self.windows.context_tokens(max_tokens) + int(self.pinned),
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
        self.ctx.memory.seq_rm(PIN_SEQ, 0, cells - 1)

    def clear(self) -> None:
        """Empty the drafting sequences (but the pin)."""
        if self.pinned:
            self.ctx.memory.seq_rm(0)
        else:
            self.ctx.memory.clear()

    def draft_from_first(self, first: Stage, windows: list[Stage], job: Job, batch: Batch) -> None:
        """The first stage (the sink and a first window), then `windows` beside the sink."""
        self._draft_stage(first, job, batch)
        self._draft_windows(windows, min(self.windows.sink, first.end) - 1, job, batch)

    def draft_as_lane(self, windows: list[Stage], job: Job) -> None:
        """A lane's part of a prompt (its scorer begun with the lead's): the sink again, which the lead
        captured, then its windows."""
        batch = Batch(self.n_batch, 1)
        try:
            self.clear()
            sink = min(self.windows.sink, windows[0].start)
            self.scorer.enable(False)
            for start in range(0, sink, self.n_batch):
                batch.clear()
                batch.add_sequence(job.tokens[start:min(sink, start + self.n_batch)], start, 0, False)
                self._decode_politely(batch, job)
            self.scorer.enable(True)
            self._draft_windows(windows, sink - 1, job, batch)
        finally:
            self.clear()
            batch.close()

    def _draft_windows(self, windows: list[Stage], bridge: int, job: Job, batch: Batch) -> None:
        """The windows one after another, each beside the sink whose last cell is `bridge`."""
        for stage in windows:
            bridge = self._enter_window(stage, bridge)
            self._draft_stage(stage, job, batch)

    def _enter_window(self, stage: Stage, bridge: int) -> int:
        """Drop the previous window's cells, keeping the sink, and move the sink's last cell to just
        before this window: llama.cpp wants each sequence to continue at its last position + 1, and
        a cell of the previous window there would carry that window into this one."""
        self.ctx.memory.seq_rm(0, bridge + 1, -1)
        if bridge < 0:
            return -1  # no sink: the sequence is empty, and may start anywhere
        self.ctx.memory.seq_add(0, bridge, bridge + 1, stage.start - 1 - bridge)
        return stage.start - 1

    def _draft_stage(self, stage: Stage, job: Job, batch: Batch) -> None:
        """Decode a stage chunk by chunk and politely (see Drafter.run), telling the scorer the chunk's
        prompt positions where its rows are not in prompt order (lanes)."""
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

    def _decode_politely(self, batch: Batch, job: Job) -> None:
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
                self._abort_if = never

    def close(self) -> None:
        self.ctx.close()
        self.scorer.close()
