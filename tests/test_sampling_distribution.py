"""Every sampling path draws from the distribution its parameters define: a chi-square test of the
frequencies of many seeded draws against the distribution computed here in float64, on known
logits: a logit bias lifts 16 tokens to 20, 19.73, ..., 16 (far above the rest of the row, whose
values are known too: a fixed row on the host; on the device, the tiny model's logits read on the
host), so that each truncation has something to cut. The draws are seeded: the tests are
deterministic. Each test also shows its power: the same draws are rejected against the
distribution with any parameter of the case dropped (each single case's parameter changes it),
and the combined case against temperature applied before the truncations."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest

from pflash_plugin.engine.batch_sampling import RowParams, bias_rows, penalize_rows, sample_rows
from pflash_plugin.llama import Batch, Context, ContextConfig, Model, SamplerChain, SamplerParams

LIFTED = np.arange(40, 56)  # the 16 tokens the bias lifts, by 20 down to 16
BIAS = {int(t): 20.0 - 4.0 * i / 15 for i, t in enumerate(LIFTED)}
HISTORY = [int(LIFTED[0])] * 3 + [int(LIFTED[1]), int(LIFTED[4]), int(LIFTED[4]), 7]
NO_TRUNCATION = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
CASES = {
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.2},
    "combined": {"temperature": 0.6, "top_k": 12, "top_p": 0.8, "min_p": 0.05},
    "penalties": {"repeat_penalty": 1.05, "frequency_penalty": 0.4, "presence_penalty": 0.5},
}
CHANGED = 0.02  # total variation at which a dropped parameter counts as changing the distribution
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
           "frequency_penalty": 0.0, "presence_penalty": 0.0}


def params(case: str, logits: np.ndarray, **extra) -> SamplerParams:
    """The case's parameters, with a bias that brings the lifted tokens of `logits` to BIAS's values."""
    bias = {t: value - float(logits[t]) for t, value in BIAS.items()}
    return SamplerParams(**{**NO_TRUNCATION, **CASES[case], "logit_bias": bias, "penalty_last_n": 64, **extra})


def expected(logits: np.ndarray, p: SamplerParams, history: list[int], temperature_first: bool = False) -> np.ndarray:
    """llama.cpp's chain written out in float64: bias, penalties, top-k, top-p, min-p, temperature
    (`temperature_first`: the mistake of scaling before the truncations)."""
    z = logits.astype(np.float64).copy()
    for token, bias in p.logit_bias.items():
        z[token] += bias
    for token, count in Counter(history[-p.penalty_last_n:]).items():
        z[token] = z[token] * p.repeat_penalty if z[token] <= 0 else z[token] / p.repeat_penalty
        z[token] -= count * p.frequency_penalty + p.presence_penalty
    if temperature_first:
        z, p = z / p.temperature, dataclasses.replace(p, temperature=1.0)
    order = np.argsort(-z, kind="stable")
    keep = order[:p.top_k] if p.top_k > 0 else order
    if p.top_p < 1.0:
        probs = np.exp(z[keep] - z[keep[0]])
        cumulative = np.cumsum(probs / probs.sum())
        keep = keep[:int(np.searchsorted(cumulative, p.top_p)) + 1]
    if p.min_p > 0.0:
        keep = keep[z[keep] >= z[keep].max() + math.log(p.min_p)]
    out = np.zeros(z.size)
    weights = np.exp((z[keep] - z[keep].max()) / p.temperature)
    out[keep] = weights / weights.sum()
    return out


def chi_square_rejects(draws: list[int], probs: np.ndarray) -> bool:
    """Pearson's test at alpha 1e-4 (the critical value by Wilson-Hilferty); tokens expected fewer
    than 5 times share one bin; a draw of a token of probability 0 rejects outright."""
    n = len(draws)
    counts = np.bincount(draws, minlength=probs.size)
    if counts[probs == 0].any():
        return True
    big = probs * n >= 5
    observed = list(counts[big]) + [counts[~big & (probs > 0)].sum()]
    wanted = list(probs[big] * n) + [probs[~big].sum() * n]
    bins = [(o, e) for o, e in zip(observed, wanted) if e > 0]
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    critical = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3
    return statistic > critical


def dropped(p: SamplerParams, case: str) -> list[SamplerParams]:
    """p with each of its case's parameters, and the logit bias, set back to neutral."""
    return ([dataclasses.replace(p, **{name: NEUTRAL[name]}) for name in CASES[case]]
            + [dataclasses.replace(p, logit_bias={})])


def check(draws: list[int], logits: np.ndarray, p: SamplerParams, case: str, history: list[int]) -> None:
    right = expected(logits, p, history)
    assert not chi_square_rejects(draws, right)
    wrongs = [expected(logits, wrong, history) for wrong in dropped(p, case)]
    if case == "combined":
        wrongs.append(expected(logits, p, history, temperature_first=True))
    changed = [wrong for wrong in wrongs if 0.5 * np.abs(wrong - right).sum() > CHANGED]
    assert len(changed) >= (len(wrongs) if case != "combined" else 3), f"{case}: a parameter that changes nothing"
    for wrong in changed:
        assert chi_square_rejects(draws, wrong), f"{case}: the draws fit a distribution with a parameter dropped"


@pytest.fixture(scope="module")
def model(tiny_model) -> Model:
    return Model(tiny_model)


@pytest.fixture(scope="module")
def row(model) -> np.ndarray:
    return (np.random.default_rng(11).standard_normal(model.n_vocab) * 2.5).astype(np.float32)


@pytest.mark.parametrize("case", CASES)
def test_the_batch_path_draws_from_the_distribution(row, case):
    """100 rows at once, each with its own generator, 100 steps: 10,000 draws."""
    p = params(case, row)
    history = HISTORY if case == "penalties" else []
    generators = [np.random.default_rng(seed) for seed in range(100)]
    draws: list[int] = []
    for _ in range(100):
        logits = np.repeat(row[None, :], len(generators), axis=0)
        rp = RowParams.of([(k, p, history, rng) for k, rng in enumerate(generators)])
        bias_rows(logits, rp)
        penalize_rows(logits, rp)
        draws += [t for t in sample_rows(logits, rp) if t is not None]
    assert len(draws) == 10_000
    check(draws, row, p, case, history)


@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_s_host_chain_draws_from_the_distribution(model, row, case):
    p = params(case, row, seed=3)
    history = HISTORY if case == "penalties" else []
    chain = SamplerChain(model, p)
    try:
        for token in history:
            chain.accept(token)
        draws = [chain.apply(row.copy()) for _ in range(10_000)]
    finally:
        chain.close()
    check(draws, row, p, case, history)


@pytest.mark.parametrize("case", CASES)
def test_the_device_path_draws_from_the_distribution(model, case):
    """llama.cpp's backend sampling (here on the CPU backend): 32 sequences each decode one token
    at position 0 with their own seeded chain, 300 times: 9,600 draws inside llama_decode, against
    the distribution of the logits the same decode gives on the host."""
    n_seqs, token = 32, 100
    history = HISTORY if case == "penalties" else []
    ctx = Context(model, ContextConfig(n_ctx=256, n_batch=n_seqs, n_seq_max=n_seqs, n_outputs_max=n_seqs,
                                       n_outputs_max_per_seq=1, n_threads=1, n_threads_batch=1))
    batch = Batch(n_seqs, 1)
    chains: list[SamplerChain] = []
    try:
        batch.add(token, 0, 0, True)
        ctx.decode(batch)
        logits = ctx.logits(0)
        ctx.memory.seq_rm(0)
        p = params(case, logits)
        for seq in range(n_seqs):
            chains.append(SamplerChain(model, dataclasses.replace(p, seed=seq), device=True))
            for t in history:
                chains[-1].accept(t)
            assert ctx.set_sampler(seq, chains[-1].ptr)
        draws: list[int] = []
        for _ in range(300):
            batch.clear()
            for seq in range(n_seqs):
                batch.add(token, 0, seq, True)
            ctx.decode(batch)
            draws += [ctx.sampled_token(i) for i in range(n_seqs)]
            for seq in range(n_seqs):
                ctx.memory.seq_rm(seq)
    finally:
        for seq in range(len(chains)):
            ctx.set_sampler(seq, None)
        for chain in chains:
            chain.close()
        batch.close()
        ctx.close()
    check(draws, logits, p, case, history)
