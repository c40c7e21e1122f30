"""Which drafted tokens a row keeps: speculative decoding's acceptance rule, on the host, no model.

The target decoded the row's last token and its k drafts in one step: k+1 rows of logits. Greedy
rows keep drafts while each equals what the greedy path (engine/batch_sampling.py) would have
picked one token at a time, then take that pick. Sampled rows use standard speculative rejection
sampling (Leviathan et al. 2023, Chen et al. 2023): a draft x proposed with probability q(x) is
kept with probability min(1, p(x) / q(x)), where p is the target's distribution at that position as
llama.cpp's chain gives it (penalties -> top-k -> top-p -> min-p -> temperature, computed by
`batch_sampling.distribution`); at the first rejection the next token is drawn from
norm(max(p - q, 0)); when every draft is kept, a bonus token is drawn from the last row. The
emitted tokens then follow p exactly, whatever q is. A deterministic proposer (n-gram lookup, a
greedy draft model) has a one-hot q: there each position draws its token as the batch path does
and the draft is kept while it equals the draw (kept with probability p(x), as rejection sampling
keeps it), so a seed gives the very tokens it gives without speculation (`_coupled`). Every
uniform comes from the row's own generator, so a seeded request stays reproducible; with no
drafts the one draw is exactly the batch path's.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...llama import SamplerParams
from ..batch_sampling import RowParams, distribution, draw, penalize_rows, penalizes, pick


def accept(target: np.ndarray, drafts: Sequence[int], params: SamplerParams, generated: Sequence[int],
           rng: np.random.Generator, draft_probs: np.ndarray | None = None) -> tuple[int, int | None]:
    """(drafts kept, the token after them) for one row. `target`: [k+1, n_vocab] float32 logits of
    the verified positions, after logit bias (and min_tokens' suppression), before penalties;
    `generated`: the row's generated tokens before the drafts (position j's penalty window also
    holds drafts[:j]); `draft_probs`: [k, n_vocab], the distribution each draft was drawn from
    (None: a deterministic proposal). The next token is None where the row it comes from has no
    finite maximum: the caller's chain decides that row (as `batch_sampling.sample_rows` says)."""
    _check(target, drafts, draft_probs)
    rows = _penalized(target, drafts, params, generated)
    if params.temperature <= 0:
        return _greedy(rows, drafts)
    if draft_probs is None:
        return _coupled(rows, drafts, params, rng)
    return _rejection(rows, drafts, params, rng, draft_probs)


def _rejection(rows: np.ndarray, drafts: Sequence[int], params: SamplerParams, rng: np.random.Generator,
               draft_probs: np.ndarray) -> tuple[int, int | None]:
    """Drafts drawn from q: each kept with probability min(1, p(x) / q(x)); at the first rejection
    the token is drawn from norm(max(p - q, 0)); all kept, the bonus from the last row."""
    for j, x in enumerate(drafts):
        dist = distribution(rows[j], params.top_k, params.top_p, params.min_p, params.temperature)
        if dist is None:
            return j, None
        ids, probs = dist
        q = draft_probs[j].astype(np.float64)
        if not rng.random() * float(q[x]) < float(probs[ids == x].sum()):
            weights = np.maximum(probs - q[ids], 0.0)
            if not weights.sum() > 0:  # p == q up to rounding, where a rejection only comes from rounding
                weights = probs
            return j, pick(ids, weights, rng.random())
    k = len(drafts)
    return k, draw(rows[k], params.top_k, params.top_p, params.min_p, params.temperature, rng.random())


def _coupled(rows: np.ndarray, drafts: Sequence[int], params: SamplerParams,
             rng: np.random.Generator) -> tuple[int, int | None]:
    """One-hot drafts: each position draws its token as the batch path would, from the row's own
    generator, and a draft is kept while it equals the draw. A draft x is still kept with
    probability p(x) (what rejection sampling gives a one-hot q), but the tokens are the ones the
    request draws without speculation, a uniform per token: a seed gives the same text with or
    without drafts, whatever the policy drafted (measured step costs do not change it)."""
    k = len(drafts)
    for j in range(k):
        token = draw(rows[j], params.top_k, params.top_p, params.min_p, params.temperature, rng.random())
        if token != drafts[j]:
            return j, token
    return k, draw(rows[k], params.top_k, params.top_p, params.min_p, params.temperature, rng.random())


def _check(target: np.ndarray, drafts: Sequence[int], draft_probs: np.ndarray | None) -> None:
    k = len(drafts)
    if target.ndim != 2 or target.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of logits, not an array of shape {target.shape}")
    n_vocab = target.shape[1]
    if any(not 0 <= int(x) < n_vocab for x in drafts):
        raise ValueError(f"a draft token is outside the vocabulary of {n_vocab} tokens: {list(drafts)}")
    if draft_probs is not None and draft_probs.shape != (k, n_vocab):
        raise ValueError(f"draft_probs must be [{k}, {n_vocab}], not {draft_probs.shape}")


def _penalized(target: np.ndarray, drafts: Sequence[int], params: SamplerParams,
               generated: Sequence[int]) -> np.ndarray:
    """The rows after llama.cpp's penalties, each over its own window (the batch path's code)."""
    if not penalizes(params) or params.penalty_last_n <= 0:
        return target
    history = [*generated, *drafts]
    unused = np.random.default_rng(0)  # RowParams carries a generator per row; penalties draw nothing
    rows = np.array(target, dtype=np.float32, copy=True)
    windows = [(j, params, history[:len(generated) + j], unused) for j in range(len(drafts) + 1)]
    penalize_rows(rows, RowParams.of(windows))
    return rows


def _greedy(rows: np.ndarray, drafts: Sequence[int]) -> tuple[int, int | None]:
    """Drafts kept while each is the row's argmax (the first index of the maximum, as the batch
    path and the native sampler take it); then that argmax (None where it is not a number). Row
    by row, up to the first rejection: a rejected first draft of 10 reads 1 row of 11 (11 us a
    row at a 128K vocabulary)."""
    for j, x in enumerate(drafts):
        token = _argmax(rows[j])
        if token != x:
            return j, token
    return len(drafts), _argmax(rows[len(drafts)])


def _argmax(row: np.ndarray) -> int | None:
    token = int(row.argmax())
    return None if np.isnan(row[token]) else token

