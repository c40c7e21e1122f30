"""The native batch sampler (ggml_ext/sample_cpu.cpp) gives the numpy path's tokens for the same
uniforms: each truncation, the greedy argmax and the rows it leaves to the chain. So a seed gives
the same tokens on either host path, and the numpy path's distribution tests hold for it too."""
from __future__ import annotations

import numpy as np
import pytest

from pflash_plugin.engine.batch_sampling import RowParams, draw, sample_rows
from pflash_plugin.llama import SamplerParams, native

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native library is not built")

N_VOCAB = 20_000
CASES = [  # (top_k, top_p, min_p, temperature)
    (40, 1.0, 0.0, 0.8), (40, 0.9, 0.0, 0.8), (5, 0.95, 0.05, 0.8), (200, 0.5, 0.1, 0.5),
    (0, 1.0, 0.0, 1.0), (0, 1.0, 0.05, 1.3), (0, 0.9, 0.0, 0.8), (0, 0.0, 0.0, 0.7),
    (N_VOCAB + 5, 0.8, 0.0, 1.0),  # top_k beyond the vocabulary: off
    (1, 1.0, 0.0, 1.0),
]


def table(rows: list[int], case: tuple[int, float, float, float], uniforms: np.ndarray) -> np.ndarray:
    entries = np.empty(len(rows), dtype=native.SAMPLE_ROW)
    entries["row"], entries["uniform"] = rows, uniforms
    entries["top_k"], entries["top_p"], entries["min_p"], entries["temperature"] = case
    return entries


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_native_rows_are_the_numpy_draws(case, spread):
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((32, N_VOCAB)) * spread).astype(np.float32)
    uniforms = rng.random(32)
    tokens = native.sample_rows(logits, table(list(range(32)), case, uniforms), n_threads=2)
    top_k, top_p, min_p, temperature = case
    expected = [draw(logits[r], top_k, top_p, min_p, temperature, float(uniforms[r])) for r in range(32)]
    same = sum(int(t) == e for t, e in zip(tokens, expected))
    # a whole-row top-p sums the row in another order: a float32 rounding may move its last token
    assert same >= (31 if top_k <= 0 and top_p < 1.0 else 32)
    assert len(set(tokens.tolist())) > 1 or top_k == 1 or top_p == 0.0


@pytest.mark.parametrize("case", CASES)
def test_rows_masked_by_a_grammar_draw_allowed_tokens_alike(case):
    """Rows at -inf but for a few allowed tokens (a grammar's mask; fewer than top-k): both paths
    draw the same allowed token, each uniform, 0 included, where the chain over the whole row drew
    token 0 (at -inf, weight 0) at uniform 0 and sorted the whole row for top-k."""
    rng = np.random.default_rng(17)
    logits = np.full((32, N_VOCAB), -np.inf, dtype=np.float32)
    for r in range(32):
        allowed = rng.choice(np.arange(1, N_VOCAB), size=1 + r % 7, replace=False)
        logits[r, allowed] = rng.standard_normal(allowed.size).astype(np.float32)
    uniforms = rng.random(32)
    uniforms[:4] = 0.0
    tokens = native.sample_rows(logits, table(list(range(32)), case, uniforms), n_threads=2)
    top_k, top_p, min_p, temperature = case
    expected = [draw(logits[r], top_k, top_p, min_p, temperature, float(uniforms[r])) for r in range(32)]
    assert tokens.tolist() == expected
    assert all(np.isfinite(logits[r, t]) for r, t in enumerate(expected))


def test_greedy_rows_take_the_first_maximum_and_leave_nan_rows():
    logits = np.random.default_rng(3).standard_normal((4, 1000)).astype(np.float32)
    logits[0, [700, 3, 999]] = 50.0  # ties: the first index
    logits[1, 500] = np.nan
    logits[2, :] = -np.inf  # numpy's argmax: 0
    logits[3, 999] = 60.0  # the max in the row's last, partial block
    tokens = native.sample_rows(logits, table([0, 1, 2, 3], (0, 1.0, 0.0, 0.0), np.zeros(4)), n_threads=1)
    assert tokens.tolist() == [3, -1, 0, 999]


def test_sampled_rows_without_a_finite_max_are_left_to_the_chain():
    logits = np.zeros((3, 300), dtype=np.float32)
    logits[0, 7] = np.nan
    logits[1, :] = -np.inf
    logits[2, 9] = np.inf
    tokens = native.sample_rows(logits, table([0, 1, 2], (40, 0.9, 0.0, 0.8), np.full(3, 0.5)), n_threads=1)
    assert tokens.tolist() == [-1, -1, -1]


def test_rows_index_the_step_and_bad_arguments_are_refused():
    logits = np.zeros((2, 100), dtype=np.float32)
    logits[1, 42] = 9.0
    assert native.sample_rows(logits, table([1], (0, 1.0, 0.0, 0.0), np.zeros(1)), 1).tolist() == [42]
    with pytest.raises(ValueError):
        native.sample_rows(logits, table([2], (0, 1.0, 0.0, 0.0), np.zeros(1)), 1)
    with pytest.raises(ValueError):
        native.sample_rows(logits.astype(np.float64), table([0], (0, 1.0, 0.0, 0.0), np.zeros(1)), 1)


def test_a_seed_draws_the_same_tokens_on_both_host_paths(monkeypatch):
    """sample_rows with the library and without it (numpy row by row), generators seeded alike."""
    logits = (np.random.default_rng(5).standard_normal((8, N_VOCAB)) * 3).astype(np.float32)
    params = [SamplerParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=s) for s in range(8)]

    def tokens() -> list[int | None]:
        entries = [(r, p, [], np.random.default_rng(p.seed)) for r, p in enumerate(params)]
        return [t for _ in range(5) for t in sample_rows(logits, RowParams.of(entries), n_threads=2)]

    with_library = tokens()
    monkeypatch.setattr(native, "load", lambda: None)
    assert tokens() == with_library
