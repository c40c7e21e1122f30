"""Speculative acceptance (engine/speculation/acceptance.py) keeps the target's distribution: the
tokens a row emits through drafts and rejection sampling follow llama.cpp's chain exactly (a
chi-square test, as tests/test_sampling_distribution.py does for sampling itself), for one-hot
drafts and for drafts drawn from a distribution; greedy rows pick what the batch path picks one
token at a time. Each distribution test also shows its power: the same draws are rejected against
what a wrong rule gives (the draft's own distribution, a penalty window without the drafts)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_sampling_distribution import CHANGED, HISTORY, chi_square_rejects, expected, params

from pflash_plugin.engine.batch_sampling import RowParams, bias_rows, penalize_rows, sample_row, sample_rows
from pflash_plugin.engine.speculation.acceptance import accept
from pflash_plugin.llama import SamplerParams

N_VOCAB = 600
DRAWS = 10_000


def biased(row: np.ndarray, p: SamplerParams) -> np.ndarray:
    """The row after p's logit bias, in float32 as the batch path adds it."""
    out = row.copy()
    for token, bias in p.logit_bias.items():
        out[token] += np.float32(bias)
    return out


@pytest.fixture(scope="module")
def row() -> np.ndarray:
    return (np.random.default_rng(11).standard_normal(N_VOCAB) * 2.5).astype(np.float32)


def likeliest(probs: np.ndarray, rank: int) -> int:
    return int(np.argsort(-probs, kind="stable")[rank])


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "min_p", "combined", "penalties"])
def test_one_hot_drafts_keep_the_target_distribution(row, case):
    """Two drafts a call, 10,000 seeded calls: the first token emitted follows the chain's
    distribution after `generated`, and, where the first draft was kept, the second follows it
    after `generated` and that draft (its penalty window holds it). The first draft is the
    likeliest token, the second the next likeliest: each is kept at times and rejected at times."""
    p = params(case, row)
    history = HISTORY if case == "penalties" else []
    first = expected(row, p, history)
    x0 = likeliest(first, 0)
    second = expected(row, p, [*history, x0])
    x1 = likeliest(second, 1)
    target = np.repeat(biased(row, p)[None, :], 3, axis=0)
    firsts, seconds = [], []
    for seed in range(DRAWS):
        n, token = accept(target, [x0, x1], p, history, np.random.default_rng(seed))
        assert token is not None
        firsts.append(x0 if n >= 1 else token)
        if n >= 1:
            seconds.append(x1 if n >= 2 else token)
    assert 0.05 * DRAWS < len(seconds) < 0.95 * DRAWS  # the first draft kept at times, rejected at times
    assert not chi_square_rejects(firsts, first)
    assert not chi_square_rejects(seconds, second)
    if case == "penalties":  # the window of position 1 holds the first draft
        without = expected(row, p, history)
        assert 0.5 * np.abs(without - second).sum() > CHANGED
        assert chi_square_rejects(seconds, without)


@pytest.mark.parametrize("case", ["temperature", "combined"])
def test_drafts_drawn_from_a_distribution_keep_the_target_distribution(row, case):
    """The draft of each call is drawn from q (another row's softmax over the same lifted tokens),
    then kept with min(1, p/q), else replaced from norm(max(p - q, 0)): the emitted token follows
    p, not q, and drafts are kept as often as sum(min(p, q)) says."""
    p = params(case, row)
    rng_q = np.random.default_rng(5)
    other = (rng_q.standard_normal(N_VOCAB) * 2.5).astype(np.float32)
    q = expected(other, dataclasses.replace(p, **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}), [])
    q_rows = q[None, :]
    target_p = expected(row, p, [])
    target = np.repeat(biased(row, p)[None, :], 2, axis=0)
    emitted, kept = [], 0
    for seed in range(DRAWS):
        x = int(rng_q.choice(N_VOCAB, p=q))
        n, token = accept(target, [x], p, [], np.random.default_rng(seed), draft_probs=q_rows)
        kept += n
        emitted.append(x if n == 1 else int(token))
    assert not chi_square_rejects(emitted, target_p)
    assert chi_square_rejects(emitted, q)
    rate = np.minimum(target_p, q).sum()
    assert 0.05 < rate < 0.95
    assert abs(kept - rate * DRAWS) < 4 * np.sqrt(DRAWS * rate * (1 - rate))


def one_at_a_time(raw: np.ndarray, p: SamplerParams, generated: list[int]) -> list[int]:
    """The batch path's greedy token at each position, the tokens before it generated."""
    tokens: list[int] = []
    for j in range(raw.shape[0]):
        logits = raw[j:j + 1].copy()
        rp = RowParams.of([(0, p, [*generated, *tokens], np.random.default_rng(0))])
        bias_rows(logits, rp)
        penalize_rows(logits, rp)
        token = sample_rows(logits, rp)[0]
        assert token is not None
        tokens.append(token)
    return tokens


def test_greedy_rows_pick_what_the_batch_path_picks_one_token_at_a_time():
    """Penalties and a bias on; position 1's best token is position 0's, which its penalty window
    then demotes: the greedy answer there depends on the drafts before it. Drafts that follow the
    batch path's picks for m positions then differ are kept m times, then its pick comes."""
    rng = np.random.default_rng(3)
    raw = rng.standard_normal((5, N_VOCAB)).astype(np.float32)
    raw[0, 10], raw[1, 10], raw[1, 11] = 9.0, 9.0, 8.5
    p = SamplerParams(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                      logit_bias={7: 3.0, 12: -1.0})
    generated = [3, 7, 7, 12]
    picks = one_at_a_time(raw, p, generated)
    assert picks[:2] == [10, 11]  # position 1's argmax without its window would be 10
    target = raw.copy()
    bias_rows(target, RowParams.of([(j, p, [], np.random.default_rng(0)) for j in range(5)]))
    for m in range(5):
        drafts = [*picks[:m], (picks[m] + 1) % N_VOCAB][:4]
        n, token = accept(target[:len(drafts) + 1], drafts, p, generated, np.random.default_rng(0))
        assert (n, token) == ((m, picks[m]) if m < 4 else (4, picks[4]))


def test_no_drafts_is_the_batch_path_s_own_draw(row):
    """k = 0 draws the one token with the same uniform as the batch path: a seed gives the same
    token with speculation on and nothing drafted."""
    p = params("combined", row)
    for seed in range(50):
        n, token = accept(biased(row, p)[None, :], [], p, [], np.random.default_rng(seed))
        assert (n, token) == (0, sample_row(biased(row, p), p, np.random.default_rng(seed)))


def test_bad_shapes_are_refused(row):
    p = SamplerParams()
    with pytest.raises(ValueError, match="2 drafts need 3 rows"):
        accept(np.zeros((2, N_VOCAB), np.float32), [1, 2], p, [], np.random.default_rng(0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        accept(np.zeros((2, N_VOCAB), np.float32), [N_VOCAB], p, [], np.random.default_rng(0))
    with pytest.raises(ValueError, match="draft_probs"):
        accept(np.zeros((2, N_VOCAB), np.float32), [1], p, [], np.random.default_rng(0),
               draft_probs=np.zeros((2, N_VOCAB)))

