"""Sampling many rows of one step at once, with llama.cpp's semantics: its penalties, then an argmax
(greedy) or its top-k -> top-p -> min-p -> temperature -> dist chain with an unseeded draw.

Why: llama.cpp's sampler builds a candidate array of the whole vocabulary for each row (0.7 ms a row
for 262K tokens, 1 ms with a repeat penalty), and the engine samples one row per running slot every
step. Here the whole-vocabulary work is a max and a comparison per row; the chain itself runs on
the top-k candidates. Seeded requests keep llama.cpp's sampler, whose random stream stock
llama_cpp.server reproduces.
"""
from __future__ import annotations

import math

import numpy as np

from ..llama import SamplerParams


def penalize_rows(logits: np.ndarray, rows: list[tuple[int, SamplerParams, list[int]]]) -> None:
    """llama.cpp's penalties, in place on rows of logits, in float32 as its sampler computes them:
    for each (row, params, generated tokens), each of the last penalty_last_n generated tokens (the
    ones the row's chain accepted) is divided (if positive) or multiplied by the repeat penalty,
    then lowered by its count times the frequency penalty plus the presence penalty. The windows of
    all rows are counted in one numpy pass (row by row it cost about 22 µs a row)."""
    active = [(row, p, generated[-p.penalty_last_n:]) for row, p, generated in rows
              if p.penalty_last_n > 0 and generated
              and (p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)]
    if not active:
        return
    n_vocab = logits.shape[1]
    keys = np.concatenate([np.asarray(window, dtype=np.int64) + i * n_vocab for i, (_, _, window) in enumerate(active)])
    pairs, counts = np.unique(keys, return_counts=True)
    which, tokens = np.divmod(pairs, n_vocab)
    params = np.asarray([(row, p.repeat_penalty, p.frequency_penalty, p.presence_penalty) for row, p, _ in active])
    rows_at, repeat, frequency, presence = params[which].T
    where = (rows_at.astype(np.int64), tokens)
    values = logits[where]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # inf where llama.cpp gives inf
        repeat32 = repeat.astype(np.float32)  # llama.cpp takes the penalties as floats
        values = np.where(values <= 0, values * repeat32, values / repeat32).astype(np.float32)
        values -= counts.astype(np.float32) * frequency.astype(np.float32) + presence.astype(np.float32)
    logits[where] = values


def top_k_candidates(row: np.ndarray, k: int, peak: float) -> np.ndarray:
    """The ids of the row's k largest logits, largest first: a margin below the max (`peak`) is
    widened (counting only) until k tokens are in it, then those alone are sorted."""
    margin = 1.0
    while np.count_nonzero(row >= peak - margin) < k and margin < 1e6:
        margin *= 4.0
    ids = np.flatnonzero(row >= peak - margin)
    if ids.size < k:  # logits spread wider than any margin: take the whole row
        ids = np.arange(row.size)
    if ids.size > k:
        ids = ids[np.argpartition(row[ids], -k)[-k:]]
    return ids[np.argsort(-row[ids], kind="stable")]


def sample_row(row: np.ndarray, p: SamplerParams, rng: np.random.Generator) -> int | None:
    """llama.cpp's top-k -> top-p -> min-p -> temperature -> dist on one (penalized) row, in float32
    as it computes; None where the row's max is not finite (the caller's chain decides)."""
    peak = row.max()
    if not np.isfinite(peak):
        return None
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # huge parameters: inf, as in llama.cpp
        return _truncate_and_draw(row, peak, p, rng)


def _truncate_and_draw(row: np.ndarray, peak: float, p: SamplerParams, rng: np.random.Generator) -> int:
    ids = top_k_candidates(row, min(p.top_k, row.size), peak)
    logits = row[ids].astype(np.float32)
    if p.top_p < 1.0:  # softmax over the candidates, then the shortest head whose mass reaches top_p
        probs = np.exp(logits - logits[0])
        probs /= np.float32(probs.sum(dtype=np.float32))
        reached = np.flatnonzero(np.cumsum(probs, dtype=np.float32) >= np.float32(p.top_p))
        keep = int(reached[0]) + 1 if reached.size else ids.size
        ids, logits = ids[:keep], logits[:keep]
    if p.min_p > 0.0:  # logits within log(min_p) of the best; the best always stays
        floor = logits[0] + np.float32(math.log(p.min_p))
        keep = max(1, int(np.count_nonzero(logits >= floor)))
        ids, logits = ids[:keep], logits[:keep]
    logits = logits / np.float32(p.temperature)
    weights = np.exp(logits - logits.max()).astype(np.float64)
    cumulative = np.cumsum(weights)
    choice = int(np.searchsorted(cumulative, cumulative[-1] * rng.random(), side="left"))
    return int(ids[min(choice, ids.size - 1)])
