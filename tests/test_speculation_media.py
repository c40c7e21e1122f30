"""Speculation beside media (issues 46, 47): a draft model cannot decode a row whose tokens hold
media pseudo-tokens (negative ids), so such rows are never given to it; the text rows batched with
them keep drafting (prompt lookup still reads such rows: it never drafts a pseudo-token, ngram.py)."""
from __future__ import annotations

import logging

from test_media_engine import PROMPT, image, run
from test_speculation_policy import free

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams
from pflash_plugin.engine.speculation.draft_model import DraftModelProposer
from pflash_plugin.engine.speculation.setup import SpeculationConfig
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_a_draft_model_never_gets_an_image_row_and_the_text_rows_beside_it_keep_drafting(caplog):
    spec = SpeculationConfig(str(cached_tiny_llama(quant="q4_0")), num_pred_tokens=4, n_threads=1, n_threads_batch=1)
    config = EngineConfig(n_slots=3, max_ctx=512, n_threads=1, n_threads_batch=1, speculation=spec,
                          mmproj=str(cached_tiny_projector()))
    model, engine = load_engine(cached_tiny_llama(), config)
    engine.scheduler.steps.speculation.policy.budget = free()  # every step may draft: the rows given to it
    try:
        prompt = engine.media.prompt(PROMPT, [image(1)])
        pictured = Request(prompt.tokens, GREEDY, media=prompt.spans)
        texts = [Request(model.tokenize(p), GREEDY) for p in ("one two three four one two", "hello world")]
        with caplog.at_level(logging.WARNING, logger="pflash_plugin.engine.speculation.draft_model"):
            ends = run(engine, [pictured, *texts])
        assert all(isinstance(end, FinishEvent) for end in ends)
        assert not [r for r in caplog.records if "could not decode" in r.getMessage()]
        proposer = engine.scheduler.steps.speculation.proposer
        assert isinstance(proposer, DraftModelProposer) and not proposer.reads_media
        assert engine.stats().speculation.drafted > 0
    finally:
        engine.stop()
        engine.close()

