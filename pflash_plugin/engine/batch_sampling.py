"""Sampling many rows of one step at once on the host, with llama.cpp's semantics: its logit bias,
its penalties, then an argmax (greedy) or its top-k -> top-p -> min-p -> temperature -> dist chain,
each row drawing from its own generator.

Why: llama.cpp's sampler builds a candidate array of the whole vocabulary for each row (0.7 ms a row
for 262K tokens, 1 ms with a repeat penalty), and the engine samples one row per running slot every
step. Here the whole-vocabulary work is a max and a comparison per row; the chain itself runs on
the top-k candidates. The native sampler (ggml_ext/sample_cpu.cpp) does the same in C, the rows
in parallel; numpy serves where it is not built. The rows' parameters come as arrays (`RowParams`,
vLLM v1's SamplingMetadata), built once per step. A generator per row (seeded by the request's
seed) makes a request's tokens its own: the same seed gives the same tokens alone or beside any
other rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..llama import SamplerParams, native

@dataclass
class RowParams:
    """The batch path's rows of one step as arrays: entry k of each array belongs to logits row
    `rows[k]`. Penalty windows are the rows' last penalty_last_n generated tokens (empty: none);
    the logit biases are flat (row position, token, bias) triples."""

    rows: np.ndarray  # int64 rows of the step's logits
    temperature: np.ndarray  # float32; <= 0: greedy
    top_k: np.ndarray  # int64; <= 0: the whole vocabulary
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    repeat: np.ndarray  # float32
    frequency: np.ndarray  # float32
    presence: np.ndarray  # float32
    windows: list[np.ndarray]
    bias_at: np.ndarray  # int64 positions into `rows`
    bias_tokens: np.ndarray  # int64
    bias_values: np.ndarray  # float32
    generators: list[np.random.Generator]

    @classmethod
    def of(cls, entries: list[tuple[int, SamplerParams, list[int], np.random.Generator]]) -> RowParams:
        """From (logits row, parameters, generated tokens, generator) per row."""
        def column(name: str, dtype: type) -> np.ndarray:
            with np.errstate(over="ignore"):  # past float32 (a temperature of 1e300): inf, as llama.cpp's C float
                return np.asarray([getattr(p, name) for _, p, _, _ in entries], dtype=dtype)

        windows = [np.asarray(generated[-p.penalty_last_n:] if p.penalty_last_n > 0 and penalizes(p) else [],
                              dtype=np.int64) for _, p, generated, _ in entries]
        biases = [p.bias_arrays for _, p, _, _ in entries]
        at = np.repeat(np.arange(len(entries), dtype=np.int64), [tokens.size for tokens, _ in biases])
        return cls(rows=np.asarray([row for row, _, _, _ in entries], dtype=np.int64),
                   temperature=column("temperature", np.float32), top_k=column("top_k", np.int64),
                   top_p=column("top_p", np.float32), min_p=column("min_p", np.float32),
                   repeat=column("repeat_penalty", np.float32), frequency=column("frequency_penalty", np.float32),
                   presence=column("presence_penalty", np.float32), windows=windows,
                   bias_at=at, bias_tokens=np.concatenate([t for t, _ in biases]) if biases else np.empty(0, np.int64),
                   bias_values=np.concatenate([v for _, v in biases]) if biases else np.empty(0, np.float32),
                   generators=[rng for _, _, _, rng in entries])


def penalizes(p: SamplerParams) -> bool:
    return p.repeat_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def bias_rows(logits: np.ndarray, rp: RowParams) -> None:
    """llama.cpp's logit bias, in place (float32 additions, as its sampler does)."""
    if rp.bias_at.size:
        logits[rp.rows[rp.bias_at], rp.bias_tokens] += rp.bias_values


def penalize_rows(logits: np.ndarray, rp: RowParams) -> None:
    """llama.cpp's penalties, in place on rows of logits, in float32 as its sampler computes them:
    each token of a row's window is divided (if positive) or multiplied by the repeat penalty,
    then lowered by its count times the frequency penalty plus the presence penalty. The windows of
    all rows are counted in one numpy pass (row by row it cost about 22 µs a row)."""
    active = [k for k, window in enumerate(rp.windows) if window.size]
    if not active:
        return
    n_vocab = logits.shape[1]
    keys = np.concatenate([rp.windows[k] + i * n_vocab for i, k in enumerate(active)])
    pairs, counts = np.unique(keys, return_counts=True)
    which, tokens = np.divmod(pairs, n_vocab)
    at = np.asarray(active, dtype=np.int64)[which]
    where = (rp.rows[at], tokens)
    values = logits[where]
    repeat = rp.repeat[at]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # inf where llama.cpp gives inf
        values = np.where(values <= 0, values * repeat, values / repeat).astype(np.float32)
        values -= counts.astype(np.float32) * rp.frequency[at] + rp.presence[at]
    logits[where] = values


def sample_rows(logits: np.ndarray, rp: RowParams, n_threads: int = 1) -> list[int | None]:
    """Each row's token (after `bias_rows` and `penalize_rows`): the argmax of a greedy row, a
    draw from its own generator for the others; None where the row's max is not a number (greedy)
    or not finite (sampled): the caller's chain decides. The native sampler (llama/native.py) takes
    the rows in parallel where it is built; numpy row by row otherwise, with the same uniforms, so
    both give a seed the same tokens."""
    sampled = rp.temperature > 0
    uniforms = np.asarray([rng.random() if on else 0.0 for rng, on in zip(rp.generators, sampled)])
    table = np.empty(rp.rows.size, dtype=native.SAMPLE_ROW)
    table["row"], table["uniform"], table["temperature"] = rp.rows, uniforms, rp.temperature
    table["top_p"], table["min_p"], table["top_k"] = rp.top_p, rp.min_p, np.clip(rp.top_k, -1, 2**31 - 1)
    tokens = native.sample_rows(logits, table, n_threads) if logits.flags.c_contiguous else None
    if tokens is not None:
        return [int(t) if t >= 0 else None for t in tokens]
    return [_numpy_row(logits[row["row"]], row) for row in table]


def greedy_rows(logits: np.ndarray, rows: np.ndarray, n_threads: int = 1) -> list[int | None]:
    """Each of `rows`' argmax (the first index of its max; None where that is NaN), as
    `sample_rows` gives a greedy row without bias or penalties, but without building a `RowParams`
    (64 greedy rows: its columns cost more than the native argmax of a 1,341-token vocabulary)."""
    table = np.zeros(rows.size, dtype=native.SAMPLE_ROW)
    table["row"] = rows
    tokens = native.sample_rows(logits, table, n_threads) if logits.flags.c_contiguous else None
    if tokens is not None:
        return [int(t) if t >= 0 else None for t in tokens]
    return [_numpy_row(logits[row["row"]], row) for row in table]


def _numpy_row(row: np.ndarray, entry: np.void) -> int | None:
    if entry["temperature"] <= 0:
        best = int(row.argmax())
        return None if np.isnan(row[best]) else best
    return draw(row, int(entry["top_k"]), float(entry["top_p"]), float(entry["min_p"]),
                float(entry["temperature"]), float(entry["uniform"]))


def top_k_candidates(row: np.ndarray, k: int, peak: float) -> np.ndarray:
    """The ids of the row's k largest logits, largest first: a margin below the max (`peak`) is
    widened (counting only) until k tokens are in it, then those alone are sorted. Tokens at -inf
    (a grammar's mask) have no probability and are never candidates: a row with fewer allowed tokens
    than k gives those (as ggml_ext/sample_cpu.cpp does; sorting the whole row cost ~1 ms at 128K)."""
    k = min(k, int(np.count_nonzero(row > -np.inf)))
    margin = 1.0
    while np.count_nonzero(row >= peak - margin) < k and margin < 1e6:
        margin *= 4.0
    ids = np.flatnonzero(row >= peak - margin)
    if ids.size < k:  # logits spread wider than any margin: every allowed token
        ids = _allowed(row)
    if ids.size > k:
        ids = ids[np.argpartition(row[ids], -k)[-k:]]
    return ids[np.argsort(-row[ids], kind="stable")]


def sample_row(row: np.ndarray, p: SamplerParams, rng: np.random.Generator) -> int | None:
    """One (penalized) row drawn with p's truncations and temperature (see `draw`)."""
    return draw(row, p.top_k, p.top_p, p.min_p, p.temperature, rng.random())


def draw(row: np.ndarray, top_k: int, top_p: float, min_p: float, temperature: float,
         uniform: float) -> int | None:
    """llama.cpp's top-k -> top-p -> min-p -> temperature -> dist on one row, in float32 as it
    computes, the draw at `uniform` in [0, 1); None where the row's max is not finite (the caller's
    chain decides)."""
    chain = _chain(row, top_k, top_p, min_p, temperature)
    if chain is None:
        return None
    ids, weights = chain
    with np.errstate(over="ignore", invalid="ignore"):  # inf weights (huge parameters), as in llama.cpp
        return pick(ids, weights, uniform)


def distribution(row: np.ndarray, top_k: int, top_p: float, min_p: float,
                 temperature: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The distribution `draw` draws from: the ids the chain keeps and their probabilities
    (float64, summing to 1); None where the row's max is not finite. Speculative decoding's
    rejection sampling needs the probabilities themselves, not one draw."""
    chain = _chain(row, top_k, top_p, min_p, temperature)
    if chain is None:
        return None
    ids, weights = chain
    return ids, weights / weights.sum()


def pick(ids: np.ndarray, weights: np.ndarray, uniform: float) -> int:
    """The id at `uniform` in [0, 1) of the cumulative (unnormalized, non-negative) weights."""
    cumulative = np.cumsum(weights)
    choice = int(np.searchsorted(cumulative, cumulative[-1] * uniform, side="left"))
    return int(ids[min(choice, ids.size - 1)])


def _chain(row: np.ndarray, top_k: int, top_p: float, min_p: float,
           temperature: float) -> tuple[np.ndarray, np.ndarray] | None:
    peak = row.max()
    if not np.isfinite(peak):
        return None
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # huge parameters: inf, as in llama.cpp
        ids = _top_k(row, top_k, peak, sort=top_p < 1.0)
        return _truncate(row, ids, top_p, min_p, temperature)


def _top_k(row: np.ndarray, k: int, peak: float, sort: bool) -> np.ndarray:
    """The top-k stage's ids, largest first. k <= 0 keeps the whole row, in its own order unless
    top-p needs it sorted (min-p and the draw need no order)."""
    if 0 < k < row.size:
        return top_k_candidates(row, k, peak)
    ids = _allowed(row)
    return ids[np.argsort(-row[ids], kind="stable")] if sort else ids


def _allowed(row: np.ndarray) -> np.ndarray:
    """The ids of the row's tokens above -inf, ascending (the others have no probability)."""
    return np.flatnonzero(row > -np.inf)


def _truncate(row: np.ndarray, ids: np.ndarray, top_p: float, min_p: float,
              temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """top-p, min-p and temperature on the top-k stage's ids: the ids kept and their weights
    (float64, unnormalized)."""
    logits = row[ids].astype(np.float32)
    if top_p < 1.0:  # softmax over the candidates, then the shortest head whose mass reaches top_p
        probs = np.exp(logits - logits[0])
        probs /= np.float32(probs.sum(dtype=np.float32))
        reached = np.flatnonzero(np.cumsum(probs, dtype=np.float32) >= np.float32(top_p))
        keep = int(reached[0]) + 1 if reached.size else ids.size
        ids, logits = ids[:keep], logits[:keep]
    if min_p > 0.0:  # logits within log(min_p) of the best; the best always stays
        kept = logits >= logits.max() + np.float32(math.log(min_p))
        ids, logits = ids[kept], logits[kept]
    logits = logits / np.float32(temperature)
    return ids, np.exp(logits - logits.max()).astype(np.float64)
