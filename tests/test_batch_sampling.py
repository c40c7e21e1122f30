"""Rows sampled together (engine/batch_sampling.py) follow llama.cpp's own sampler chain."""
from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import pytest

from pflash_plugin.engine.batch_sampling import RowParams, sample_row, top_k_candidates
from pflash_plugin.llama import Model, SamplerChain, SamplerParams

DRAWS = 40_000
CASES = [
    {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8},  # llama_cpp.server's defaults
    {"top_k": 10, "top_p": 1.0, "min_p": 0.0, "temperature": 1.5},
    {"top_k": 200, "top_p": 0.5, "min_p": 0.1, "temperature": 0.5},
    {"top_k": 60, "top_p": 0.9, "min_p": 0.0, "temperature": 2.0},
]


@pytest.fixture(scope="module")
def model(tiny_model) -> Model:
    return Model(tiny_model)


def total_variation(a: Counter, b: Counter, n: int) -> float:
    return 0.5 * sum(abs(a[t] - b[t]) for t in set(a) | set(b)) / n


def expected_noise(a: Counter, b: Counter, n: int) -> float:
    """The total variation between two samples of n from one distribution (estimated from both):
    the sum over tokens of sqrt(p (1 - p) / (pi n))."""
    return sum(math.sqrt(c / (2 * n) * (1 - c / (2 * n)) / (math.pi * n)) for c in (a + b).values())


@pytest.mark.parametrize("case", CASES)
def test_sampled_rows_follow_the_chain_distribution(model, case):
    """The same row drawn 40,000 times each way: the distributions differ by sampling noise only.
    Their total variation stays within 1.6x of what two samples of one distribution show (measured
    0.9-1.2x; temperature applied before the truncations, min-p left out or top-p's last token
    dropped gave 8.6-47x in at least one case). The draws are seeded: the test is deterministic."""
    row = (np.random.default_rng(1).standard_normal(model.n_vocab) * 2.5).astype(np.float32)
    rng = np.random.default_rng(2)
    ours = Counter(sample_row(row, SamplerParams(**case), rng) for _ in range(DRAWS))
    chain = SamplerChain(model, SamplerParams(seed=7, **case))
    try:
        theirs = Counter(chain.apply(row) for _ in range(DRAWS))
    finally:
        chain.close()
    assert total_variation(ours, theirs, DRAWS) < 1.6 * expected_noise(ours, theirs, DRAWS)
    assert len(ours) > 1


def test_top_k_candidates_are_the_k_largest_in_order():
    row = np.random.default_rng(3).standard_normal(5000).astype(np.float32) * 40  # wider than the first margins
    ids = top_k_candidates(row, 50, row.max())
    assert list(ids) == list(np.argsort(-row, kind="stable")[:50])


def test_a_row_without_a_finite_maximum_is_left_to_the_chain():
    row = np.full(100, np.nan, dtype=np.float32)
    assert sample_row(row, SamplerParams(), np.random.default_rng(0)) is None
    row[:] = -np.inf
    assert sample_row(row, SamplerParams(), np.random.default_rng(0)) is None


def test_top_k_of_a_masked_row_is_its_allowed_tokens_alone():
    """Fewer allowed tokens than k (the rest at -inf, a grammar's mask): those alone, largest
    first, not k ids padded from the whole row (sorting 128K logits a row cost ~1 ms)."""
    row = np.full(50_000, -np.inf, dtype=np.float32)
    row[[7, 40_000, 123]] = [0.5, 2.0, -1.0]
    assert top_k_candidates(row, 40, 2.0).tolist() == [40_000, 7, 123]


def test_a_parameter_past_float32_is_inf_without_a_warning():
    """The APIs bound neither temperature nor repeat_penalty above (stock's fields): 1e300 is inf in
    float32, as llama.cpp's C float takes it; the cast warned on every step of such a request."""
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = RowParams.of([(0, SamplerParams(temperature=1e300, repeat_penalty=1e300), [3], rng)])
    assert math.isinf(rows.temperature[0]) and math.isinf(rows.repeat[0])
