"""Token importance from a drafter's captured attention inputs.

PFlash keeps the prompt tokens that the end of the prompt attends to most.
At a scoring layer the drafter hands us post-RoPE Q and K; the importance of
an earlier token is the softmax attention mass it receives from the last few
query tokens, averaged over heads and queries.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["NonFiniteScores", "attention_mass", "combine_layers"]


class NonFiniteScores(ValueError):
    """NaN/Inf in the attention inputs or scores.

    Raised instead of returning scores, because a selection built on
    non-finite scores would drop arbitrary parts of the prompt silently.
    """


def _require_finite(name: str, array: np.ndarray) -> None:
    if not np.isfinite(array).all():
        raise NonFiniteScores(f"{name} contains NaN or Inf")


def _checked_query_end(q: np.ndarray, k: np.ndarray, query_start: int, query_end: int | None) -> int:
    """Refuse shapes, ranges and values that attention_mass cannot score; returns query_end."""
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(
            f"q and k must be 3-D [n_tokens, heads, head_dim], got shapes {q.shape} and {k.shape}"
        )
    n_tokens, n_head, head_dim = q.shape
    k_tokens, n_head_kv, k_head_dim = k.shape
    if k_tokens != n_tokens:
        raise ValueError(f"q has {n_tokens} tokens but k has {k_tokens}")
    if head_dim != k_head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, k has {k_head_dim}")
    if n_head < 1 or n_head_kv < 1 or head_dim < 1:
        raise ValueError(f"empty head or head_dim axis: q {q.shape}, k {k.shape}")
    if n_head % n_head_kv != 0:
        raise ValueError(
            f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv}) for grouped-query attention"
        )
    if not 1 <= query_start < n_tokens:
        raise ValueError(
            f"query_start must satisfy 1 <= query_start < n_tokens ({n_tokens}), got {query_start}"
        )
    if query_end is None:
        query_end = n_tokens
    if not query_start < query_end <= n_tokens:
        raise ValueError(
            f"query_end must satisfy query_start ({query_start}) < query_end <= n_tokens "
            f"({n_tokens}), got {query_end}"
        )
    _require_finite("q", q)
    _require_finite("k", k)
    return query_end


def attention_mass(
    q: np.ndarray,
    k: np.ndarray,
    query_start: int,
    query_end: int | None = None,
) -> np.ndarray:
    """Mean softmax attention from queries [query_start, query_end) to keys [0, query_start).

    q is [n_tokens, n_head, head_dim], k is [n_tokens, n_head_kv, head_dim]
    (grouped-query attention: query head h reads kv head h // (n_head // n_head_kv)).
    Returns float64 [query_start]; it sums to 1 because every (head, query)
    distribution does. Work is done per kv head so the largest temporary is
    [group * n_query, query_start] rather than one tensor over all heads.
    """
    q = np.asarray(q)
    k = np.asarray(k)
    query_end = _checked_query_end(q, k, query_start, query_end)
    _, n_head, head_dim = q.shape
    n_head_kv = k.shape[1]

    # float32 unless the caller gave float64; the result is accumulated in float64.
    dtype = np.result_type(q.dtype, k.dtype, np.float32)
    queries = q[query_start:query_end].astype(dtype, copy=False)
    keys = k[:query_start].astype(dtype, copy=False)
    n_query = query_end - query_start
    group = n_head // n_head_kv
    scale = dtype.type(1.0 / math.sqrt(head_dim))

    total = np.zeros(query_start, dtype=np.float64)
    # Overflow shows up as NaN/Inf in the result and is raised below, so numpy's warnings add nothing.
    with np.errstate(over="ignore", invalid="ignore"):
        for g in range(n_head_kv):
            # Rows are (query head in this group, query token); columns are keys.
            q_group = queries[:, g * group : (g + 1) * group, :]
            q_rows = q_group.transpose(1, 0, 2).reshape(group * n_query, head_dim)
            logits = (q_rows @ keys[:, g, :].T) * scale
            logits -= logits.max(axis=1, keepdims=True)
            np.exp(logits, out=logits)
            inv_denom = (1.0 / logits.sum(axis=1, dtype=np.float64)).astype(dtype)
            total += inv_denom @ logits
    total /= n_head * n_query
    _require_finite("attention mass", total)
    return total


def combine_layers(masses: list[np.ndarray]) -> np.ndarray:
    """Elementwise max over scoring layers.

    Max rather than mean so a token that one layer finds decisive is not
    diluted by layers that ignore it.
    """
    if not masses:
        raise ValueError("combine_layers needs at least one layer's mass")
    arrays = [np.asarray(m, dtype=np.float64) for m in masses]
    shape = arrays[0].shape
    if len(shape) != 1:
        raise ValueError(f"each mass must be 1-D, got shape {shape}")
    for i, array in enumerate(arrays):
        if array.shape != shape:
            raise ValueError(f"layer {i} mass has shape {array.shape}, expected {shape}")
        _require_finite(f"layer {i} mass", array)
    return np.maximum.reduce(arrays)
