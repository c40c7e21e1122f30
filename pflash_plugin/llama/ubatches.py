"""How llama.cpp cuts one llama_decode call's rows into ubatches, so the engine can count them (and
a bench can show them) without llama.cpp saying: each ubatch reads all the weights on a GPU, and
one of another shape than the one before builds a new graph (no CUDA graph replay).

With a KV stream per slot (`kv_unified = false`) llama.cpp splits by `llama_batch_allocr::
split_equal(n_ubatch, sequential=true)` (src/llama-batch.cpp): a ubatch starts at the first
sequence with rows left and adds each next sequence, in the batch's row order, whose id is one more
than the last added (a run of CONSECUTIVE ids), then takes the same number of rows from each: the
fewest any of them has left, at most n_ubatch / their count. With one stream (unified) it splits
simply: n_ubatch rows at a time."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .context import Context, Decodable


def split_equal(runs: Sequence[tuple[int, int]], n_ubatch: int) -> list[tuple[int, int]]:
    """The ubatches (sequences, rows of each) of a batch whose rows are `runs`: (sequence id, rows)
    in row order, a sequence's rows together (as the engine adds them)."""
    left = dict(runs)
    order = [seq for seq, n in runs if n > 0]
    out: list[tuple[int, int]] = []
    while order:
        run = [order[0]]
        for seq in order[1:]:  # llama.cpp scans on past ids that do not follow the last one added
            if seq == run[-1] + 1:
                run.append(seq)
        each = min(min(left[seq] for seq in run), max(1, n_ubatch // len(run)))
        for seq in run:
            left[seq] -= each
        out.append((len(run), each))
        order = [seq for seq in order if left[seq]]
    return out


def count(runs: Sequence[tuple[int, int]], n_ubatch: int, per_stream: bool) -> int:
    """How many ubatches llama.cpp makes of the batch `runs` (split_equal's above; split_simple's
    with one KV stream)."""
    if not per_stream:
        return -(-sum(n for _, n in runs) // max(n_ubatch, 1))
    return len(split_equal(runs, n_ubatch))


@dataclass
class DecodeTally:
    """llama_decode calls of one kind since start, the ubatches llama.cpp cut them into and the
    graphs it reused for them (llama_perf_context's n_reused). The engine thread writes, /status
    reads: plain ints, each read whole."""

    calls: int = 0
    ubatches: int = 0
    reused: int = 0

    def decode(self, ctx: Context, batch: Decodable, runs: Sequence[tuple[int, int]]) -> None:
        """ctx.decode(batch), counted; `runs`: the batch's rows as (sequence, rows) in row order."""
        self.calls += 1
        self.ubatches += count(runs, ctx.n_ubatch, not ctx.config.kv_unified)
        before = ctx.graph_reuses()
        try:
            ctx.decode(batch)
        finally:
            self.reused += ctx.graph_reuses() - before


@dataclass
class UbatchCounts:
    """The engine's decode calls: the step's token batch and the media calls apart."""

    step: DecodeTally = field(default_factory=DecodeTally)
    media: DecodeTally = field(default_factory=DecodeTally)
