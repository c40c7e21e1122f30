"""The engine's count of llama.cpp's ubatches (llama/ubatches.py): split_equal's rule on hand-worked
batches, checked against llama.cpp's own graph reuse on a context with a KV stream per sequence
(a ubatch of another shape than the one before cannot reuse its graph), and the runner's counts
through an engine with images (/status media's step_ubatches and decode_ubatches)."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.media import MEDIA_MARKER, MediaInput
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.llama import Batch, Context, ContextConfig, Model
from pflash_plugin.llama.ubatches import count, split_equal
from pflash_plugin.testing import cached_tiny_projector
from pflash_plugin.testing.media_files import ppm

from conftest import run_requests


def test_split_equal_takes_consecutive_sequences_and_equal_rows():
    # decode rows of consecutive slots: one ubatch; a gap starts another
    assert split_equal([(0, 1), (1, 1), (2, 1)], 512) == [(3, 1)]
    assert split_equal([(0, 1), (1, 1), (3, 1), (4, 1)], 512) == [(2, 1), (2, 1)]
    # a text chunk beside decode rows: one row of it rides with them, the rest is a ubatch of its own
    assert split_equal([(0, 1), (1, 1), (2, 10)], 512) == [(3, 1), (1, 9)]
    # equal rows from each of a run, at most n_ubatch in all; an image of 576 rows alone: 512 + 64
    assert split_equal([(5, 30), (6, 576), (7, 576)], 512) == [(3, 30), (2, 256), (2, 256), (2, 34)]
    assert split_equal([(3, 576), (7, 576)], 512) == [(1, 512), (1, 64), (1, 512), (1, 64)]
    # llama.cpp scans on past an id that does not follow: 7 is passed, 6 joins 5
    assert split_equal([(5, 1), (7, 1), (6, 1)], 512) == [(2, 1), (1, 1)]
    assert count([(0, 600), (1, 1)], 512, per_stream=False) == 2  # one stream: n_ubatch rows at a time
    assert count([(0, 600), (1, 1)], 512, per_stream=True) == 3


@pytest.fixture
def streams(tiny_model):
    model = Model(tiny_model)
    ctx = Context(model, ContextConfig(n_ctx=4 * 256, n_batch=64, n_ubatch=8, n_seq_max=4, kv_unified=False,
                                       n_threads=1, n_threads_batch=1))
    batch = Batch(64, 1)
    yield ctx, batch
    batch.close()
    ctx.close()


def test_the_count_agrees_with_llama_cpps_graph_reuse(streams):
    """A batch of one ubatch decoded again reuses its graph; a batch the rule cuts into ubatches of
    one shape (no logits) reuses the graph within the call; ubatches of two shapes never do."""
    ctx, batch = streams
    positions = [0] * 4

    def reused(runs: list[tuple[int, int]], logits: bool = True) -> int:
        batch.clear()
        for seq, n in runs:
            batch.add_sequence([5] * n, positions[seq], seq, logits)
            positions[seq] += n
        before = ctx.graph_reuses()
        ctx.decode(batch)
        return ctx.graph_reuses() - before

    one = [(0, 1), (1, 1), (2, 1)]
    assert count(one, 8, True) == 1 and [reused(one) for _ in range(3)][1:] == [1, 1]
    same = [(0, 16), (1, 16)]  # 2 sequences x 4 rows, 4 times
    assert split_equal(same, 8) == [(2, 4)] * 4 and reused(same, logits=False) == 3
    mixed = [(0, 1), (1, 1), (2, 3)]  # (3 x 1) then (1 x 2), each call
    assert split_equal(mixed, 8) == [(3, 1), (1, 2)] and [reused(mixed) for _ in range(3)] == [0, 0, 0]


def test_the_engine_counts_its_ubatches_and_reused_graphs(tiny_model):
    """Image requests through an engine: the token batches' and the media calls' ubatches and reused
    graphs reach MediaStats (/status media), at least one ubatch a call."""
    config = EngineConfig(n_slots=3, max_ctx=512, n_batch=48, n_ubatch=24, n_threads=1, n_threads_batch=1,
                          mmproj=str(cached_tiny_projector()), kv_layout="per_slot")
    _, engine = load_engine(tiny_model, config)
    try:
        prompt = f"<|im_start|>user\nlook at {MEDIA_MARKER} this<|im_end|>\n<|im_start|>assistant\n"
        requests = []
        for seed in (1, 2):
            built = engine.media.prompt(prompt, [MediaInput("image", ppm(seed), "image/x-portable-pixmap")])
            requests.append(Request(built.tokens, SamplingParams(max_tokens=8, temperature=0.0), media=built.spans))
        run_requests(engine, requests)
        stats = engine.media.stats()
        assert stats.step_calls >= 8 and stats.step_ubatches >= stats.step_calls
        assert stats.decode_ubatches >= max(stats.decode_calls, 2 * 64 // 24)  # 64 rows an image, 24 a ubatch
        assert 0 < stats.step_graphs_reused < stats.step_ubatches
        assert stats.decode_graphs_reused < stats.decode_ubatches
    finally:
        engine.stop()
        engine.close()

