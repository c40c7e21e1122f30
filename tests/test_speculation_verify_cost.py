"""What verifying a speculating row costs the host (issue 47), counted rather than timed: at a 128K
vocabulary a copy of a row's 11 logits rows took ~0.5 ms and an argmax ~11 us a row, per row and
step, where random weights reject every draft."""
from __future__ import annotations

import tracemalloc
from dataclasses import dataclass

import numpy as np

from pflash_plugin.engine.request import Request, SamplingParams, TokenOutput
from pflash_plugin.engine.speculation.acceptance import accept
from pflash_plugin.engine.speculation.verifier import Verifier

VOCAB = 50_000
GREEDY = SamplingParams(temperature=0.0, max_tokens=50)


def logits(rows: int = 12) -> np.ndarray:
    """Row j's argmax is 100 + j."""
    out = np.zeros((rows, VOCAB), np.float32)
    out[np.arange(rows), 100 + np.arange(rows)] = 1.0
    return out


class Scanned(np.ndarray):
    """Logits that count the values their argmaxes scan."""

    scanned = 0

    def argmax(self, *args, **kwargs):
        Scanned.scanned += self.size
        return super().argmax(*args, **kwargs)


def test_greedy_acceptance_reads_rows_up_to_the_first_rejection():
    rows = logits(11).view(Scanned)
    Scanned.scanned = 0
    assert accept(rows, [7] * 10, GREEDY, [], np.random.default_rng(0)) == (0, 100)
    assert Scanned.scanned == VOCAB  # the first row alone (all 11 rows before)
    Scanned.scanned = 0
    assert accept(rows[:4], [100, 101, 7], GREEDY, [], np.random.default_rng(0)) == (2, 102)
    assert Scanned.scanned == 3 * VOCAB
    assert accept(logits(4), [100, 101, 102], GREEDY, [], np.random.default_rng(0)) == (3, 103)  # the bonus


@dataclass
class Bound:
    request: Request
    params: SamplingParams
    chain: None
    rng: np.random.Generator


def verify(params: SamplingParams, drafts: list[int]) -> tuple[TokenOutput | Exception, int]:
    """A row's drafts verified against logits rows 1..k+1; the peak bytes allocated meanwhile."""
    request = Request([1, 2], params)
    request.output_tokens = [3]
    bound = Bound(request, params, None, np.random.default_rng(0))
    verifier: Verifier[Bound] = Verifier(lambda: [0], lambda b, row: TokenOutput(0))
    out = logits()
    rows = {request.request_id: (bound, [(j, j) for j in range(1, len(drafts) + 2)])}
    tracemalloc.start()
    try:
        result = verifier.verify(out, rows, {request.request_id: drafts})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result[request.request_id], peak


def test_verifying_a_row_copies_none_of_its_logits_unless_a_bias_is_added():
    out, peak = verify(GREEDY, [101, 7, 7])
    assert isinstance(out, TokenOutput) and (out.token, out.accepted) == (102, (101,))
    assert peak < VOCAB * 4  # less than one row of logits: read where llama.cpp wrote them
    biased = SamplingParams(temperature=0.0, max_tokens=50, logit_bias={7: 5.0})
    out, peak = verify(biased, [101, 7, 7])
    assert isinstance(out, TokenOutput) and (out.token, out.accepted) == (7, ())  # the bias decides
    assert peak >= 4 * VOCAB * 4  # the rows copied, the caller's left as they were
