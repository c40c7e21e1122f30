"""attention_mass is checked against a plain float64 loop, so a wrong head mapping,
scale, softmax axis or averaging shows up as a numeric mismatch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pflash_plugin.pflash.attention_mass import NonFiniteScores, attention_mass, combine_layers


def reference_mass(
    q: np.ndarray, k: np.ndarray, query_start: int, query_end: int | None = None
) -> list[float]:
    """Direct definition: per (head, query) softmax over earlier keys, averaged."""
    n_tokens, n_head, head_dim = q.shape
    n_head_kv = k.shape[1]
    group = n_head // n_head_kv
    query_end = n_tokens if query_end is None else query_end
    total = [0.0] * query_start
    count = 0
    for h in range(n_head):
        kv = h // group
        for t in range(query_start, query_end):
            logits = []
            for j in range(query_start):
                dot = sum(float(q[t, h, d]) * float(k[j, kv, d]) for d in range(head_dim))
                logits.append(dot / math.sqrt(head_dim))
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            denom = sum(weights)
            for j in range(query_start):
                total[j] += weights[j] / denom
            count += 1
    return [x / count for x in total]


def random_qk(seed: int, n_tokens: int, n_head: int, n_head_kv: int, head_dim: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((n_tokens, n_head, head_dim)) * scale).astype(np.float32)
    k = (rng.standard_normal((n_tokens, n_head_kv, head_dim)) * scale).astype(np.float32)
    return q, k


@pytest.mark.parametrize("n_head_kv", [1, 2, 4])
def test_matches_reference_loop_with_gqa(n_head_kv: int) -> None:
    q, k = random_qk(seed=n_head_kv, n_tokens=23, n_head=4, n_head_kv=n_head_kv, head_dim=8)
    got = attention_mass(q, k, query_start=17)
    assert got.dtype == np.float64
    assert got.shape == (17,)
    np.testing.assert_allclose(got, reference_mass(q, k, 17), rtol=1e-5, atol=1e-9)


def test_gqa_head_mapping_is_grouped_not_interleaved() -> None:
    # With 4 query heads on 2 kv heads, heads 0,1 read kv 0 and heads 2,3 read kv 1.
    # An interleaved mapping (h % n_head_kv) gives a different answer on these inputs.
    q, k = random_qk(seed=7, n_tokens=12, n_head=4, n_head_kv=2, head_dim=4, scale=2.0)
    got = attention_mass(q, k, query_start=9)
    k_interleaved = k[:, [0, 1, 0, 1], :]
    k_grouped = k[:, [0, 0, 1, 1], :]
    np.testing.assert_allclose(got, attention_mass(q, k_grouped, 9), rtol=1e-6)
    assert not np.allclose(got, attention_mass(q, k_interleaved, 9), rtol=1e-3)


def test_explicit_query_end_uses_only_those_queries() -> None:
    q, k = random_qk(seed=3, n_tokens=20, n_head=2, n_head_kv=1, head_dim=6)
    got = attention_mass(q, k, query_start=12, query_end=15)
    np.testing.assert_allclose(got, reference_mass(q, k, 12, 15), rtol=1e-5, atol=1e-9)
    assert not np.allclose(got, attention_mass(q, k, query_start=12), rtol=1e-3)


@pytest.mark.parametrize("seed", range(5))
def test_mass_sums_to_one(seed: int) -> None:
    q, k = random_qk(seed=seed, n_tokens=40, n_head=4, n_head_kv=2, head_dim=16)
    got = attention_mass(q, k, query_start=30)
    assert got.sum() == pytest.approx(1.0, abs=1e-6)
    assert (got >= 0).all()


def test_large_logits_are_stable() -> None:
    # Logits around several hundred overflow exp() in float32 unless the max is subtracted.
    q, k = random_qk(seed=11, n_tokens=10, n_head=2, n_head_kv=1, head_dim=8, scale=8.0)
    got = attention_mass(q, k, query_start=7)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference_mass(q, k, 7), rtol=1e-4, atol=1e-9)


def test_float64_inputs_are_accepted() -> None:
    q, k = random_qk(seed=5, n_tokens=9, n_head=2, n_head_kv=2, head_dim=4)
    got = attention_mass(q.astype(np.float64), k.astype(np.float64), query_start=6)
    np.testing.assert_allclose(got, reference_mass(q, k, 6), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("which", "index", "value"),
    [
        ("q", (15, 1, 2), np.nan),
        ("q", (12, 0, 0), np.inf),
        ("k", (3, 0, 1), np.nan),
        ("k", (0, 1, 0), np.inf),
        ("k", (5, 0, 0), -np.inf),
    ],
)
def test_non_finite_inputs_raise(which: str, index: tuple[int, int, int], value: float) -> None:
    q, k = random_qk(seed=1, n_tokens=16, n_head=2, n_head_kv=2, head_dim=4)
    (q if which == "q" else k)[index] = value
    with pytest.raises(NonFiniteScores):
        attention_mass(q, k, query_start=10)


def test_inf_key_that_softmax_would_hide_raises() -> None:
    # A -inf logit gets weight 0, so the scores would look finite; the inputs must be checked.
    q, k = random_qk(seed=2, n_tokens=8, n_head=2, n_head_kv=1, head_dim=4)
    q[:, :, 0] = np.abs(q[:, :, 0]) + 0.1
    k[2, 0, 0] = -np.inf
    with pytest.raises(NonFiniteScores, match="k"):
        attention_mass(q, k, query_start=5)


def test_overflowing_scores_raise() -> None:
    # Finite inputs whose dot products overflow float32 must not yield a selection.
    q = np.full((4, 1, 2), 1e30, dtype=np.float32)
    k = np.full((4, 1, 2), 1e30, dtype=np.float32)
    with pytest.raises(NonFiniteScores):
        attention_mass(q, k, query_start=2)


def test_non_finite_scores_is_a_value_error() -> None:
    assert issubclass(NonFiniteScores, ValueError)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "query_start", "query_end", "message"),
    [
        ((10, 4, 8), (10, 2, 8), 0, None, "query_start"),
        ((10, 4, 8), (10, 2, 8), 10, None, "query_start"),
        ((10, 4, 8), (10, 2, 8), -1, None, "query_start"),
        ((10, 4, 8), (10, 2, 8), 5, 5, "query_end"),
        ((10, 4, 8), (10, 2, 8), 5, 11, "query_end"),
        ((10, 3, 8), (10, 2, 8), 5, None, "multiple"),
        ((10, 4, 8), (10, 2, 4), 5, None, "head_dim"),
        ((10, 4, 8), (9, 2, 8), 5, None, "tokens"),
        ((10, 32), (10, 16), 5, None, "3-D"),
    ],
)
def test_shape_errors(q_shape, k_shape, query_start, query_end, message: str) -> None:
    q = np.zeros(q_shape, dtype=np.float32)
    k = np.zeros(k_shape, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        attention_mass(q, k, query_start, query_end)


def test_combine_layers_is_elementwise_max() -> None:
    a = np.array([0.1, 0.5, 0.2, 0.0])
    b = np.array([0.3, 0.1, 0.2, 0.4])
    c = np.array([0.0, 0.2, 0.6, 0.1])
    np.testing.assert_array_equal(combine_layers([a, b, c]), [0.3, 0.5, 0.6, 0.4])
    np.testing.assert_array_equal(combine_layers([a]), a)


def test_combine_layers_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        combine_layers([])
    with pytest.raises(ValueError, match="shape"):
        combine_layers([np.zeros(3), np.zeros(4)])
    with pytest.raises(NonFiniteScores):
        combine_layers([np.zeros(3), np.array([0.0, np.nan, 0.0])])
    with pytest.raises(NonFiniteScores):
        combine_layers([np.array([np.inf, 0.0]), np.zeros(2)])
