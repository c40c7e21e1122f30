"""Drafter capture, scoring on captured tensors, startup guards and fallbacks (tiny models)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from pflash_plugin.llama import Model
from pflash_plugin.pflash.compressor import CompressionJob, Compressor, PflashConfig
from pflash_plugin.pflash.drafter import Drafter, DrafterError, check_vocab, scoring_layers
from pflash_plugin.pflash.query import plan_query
from pflash_plugin.pflash.scoring import attention_mass
from pflash_plugin.testing import cached_tiny_llama


@pytest.fixture(scope="module")
def deep_model() -> Model:
    return Model(cached_tiny_llama(n_layer=4, seed=3))


def prompt_tokens(model: Model, n: int) -> list[int]:
    text = " ".join(f"line {i} tells the story of the river and the old bridge." for i in range(n))
    return model.tokenize(text)[:n]


def test_post_rope_is_a_rotation_of_pre_rope(deep_model):
    tokens = prompt_tokens(deep_model, 96)
    post = Drafter(deep_model, [1], 128, "post").run(tokens)
    pre = Drafter(deep_model, [1], 128, "pre").run(tokens)
    # position 0 is rotated by angle 0; every later position keeps its norm but not its values
    np.testing.assert_allclose(post.q[1][0], pre.q[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(post.k[1], axis=-1), np.linalg.norm(pre.k[1], axis=-1), rtol=1e-4)
    assert not np.allclose(post.q[1][10:], pre.q[1][10:])
    assert post.q[1].shape == (96, 4, 16) and post.k[1].shape == (96, 2, 16)


def test_capture_stops_after_last_scoring_layer_and_matches_full_forward(deep_model):
    tokens = prompt_tokens(deep_model, 200)
    early = Drafter(deep_model, [1], 256, n_batch=64)  # 4 ubatches
    late = Drafter(deep_model, [1, 3], 256, n_batch=64)  # runs to the last layer
    a, b = early.run(tokens), late.run(tokens)
    assert early.capture.result.ubatches_stopped == 4
    assert early.capture.result.nodes_seen < late.capture.result.nodes_seen
    assert (a.layers_run, b.layers_run) == (2, 4)
    # stopping each ubatch early leaves the layers below intact: the same K as the full forward
    np.testing.assert_allclose(a.k[1], b.k[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.q[1], b.q[1], rtol=1e-5, atol=1e-5)


def test_scoring_matches_float64_on_captured_tensors(deep_model):
    tokens = prompt_tokens(deep_model, 80)
    drafted = Drafter(deep_model, [2], 128).run(tokens)
    q, k = drafted.q[2].astype(np.float64), drafted.k[2].astype(np.float64)
    start = 72
    expected = np.zeros(start)
    group = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        for t in range(start, len(tokens)):
            logits = [float(q[t, h] @ k[j, h // group]) / math.sqrt(q.shape[2]) for j in range(start)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            expected += np.array(weights) / total
    expected /= q.shape[1] * (len(tokens) - start)
    np.testing.assert_allclose(attention_mass(drafted.q[2], drafted.k[2], start), expected, rtol=1e-4, atol=1e-7)


def test_vocabulary_mismatch_is_refused(tmp_path):
    target = Model(cached_tiny_llama())
    other = Model(cached_tiny_llama(vocab_extra=9))
    with pytest.raises(DrafterError) as error:
        check_vocab(target, other)
    assert target.path in str(error.value) and other.path in str(error.value)
    check_vocab(target, Model(cached_tiny_llama(seed=11)))  # other weights, same vocabulary: fine


def test_scoring_layer_guards():
    gemma = SimpleNamespace(architecture="gemma3", n_swa=512, n_layer=18)
    assert scoring_layers(gemma, None) == [5]
    assert scoring_layers(gemma, [11, 5]) == [5, 11]
    with pytest.raises(DrafterError, match="sliding-window"):
        scoring_layers(gemma, [4])
    with pytest.raises(DrafterError, match="recurrent"):
        scoring_layers(SimpleNamespace(architecture="mamba", n_swa=0, n_layer=8), None)
    with pytest.raises(DrafterError, match="--pflash_layers"):
        scoring_layers(SimpleNamespace(architecture="newswa", n_swa=128, n_layer=8), None)
    with pytest.raises(DrafterError, match="outside"):
        scoring_layers(SimpleNamespace(architecture="llama", n_swa=0, n_layer=8), [8])


class _NaNDrafter(Drafter):
    """Fault injection: a drafter whose capture went non-finite."""

    def run(self, tokens, *args, **kw):
        result = super().run(tokens, *args, **kw)
        for layer in result.q:
            result.q[layer][-1, 0, 0] = np.nan
        return result


def test_non_finite_scores_fall_back_to_full_prefill(deep_model):
    tokens = prompt_tokens(deep_model, 200)
    compressor = Compressor(PflashConfig(segment_min=4, segment_max=16), deep_model.piece,
                            lambda: _NaNDrafter(deep_model, [1], 256), persistent=False)
    plan = plan_query([deep_model.piece(t) for t in tokens], 8)
    result = compressor.compress(CompressionJob(tokens, plan, 0.3))
    assert result.report["status"] == "fallback" and "non-finite" in result.report["reason"]
    assert result.tokens == tokens


def test_compressor_keeps_budget_head_and_query(deep_model):
    tokens = prompt_tokens(deep_model, 400)
    compressor = Compressor(PflashConfig(segment_min=4, segment_max=16), deep_model.piece,
                            lambda: Drafter(deep_model, [1], 512), persistent=True)
    plan = plan_query([deep_model.piece(t) for t in tokens], 8, min_head=4)
    result = compressor.compress(CompressionJob(tokens, plan, 0.25))
    report = result.report
    assert report["status"] == "compressed"
    assert len(result.tokens) == report["kept_tokens"] <= 100
    assert result.tokens[:4] == tokens[:4] and result.tokens[-8:] == tokens[-8:]
    assert report["segments_kept"] < report["segments_total"] and report["layers_run"] == 2
    # a budget smaller than the mandatory spans: no compression
    skipped = compressor.compress(CompressionJob(tokens, plan_query([deep_model.piece(t) for t in tokens], 8, min_head=200), 0.25))
    assert skipped.report["status"] == "skipped" and skipped.tokens == tokens


def test_plan_query_finds_the_last_user_message():
    pieces = [b"<s>", b"<sys>", b"Be brief.", b"</sys>", b"<user>", b"Some", b" long", b" document", b".", b" Who", b" wrote", b" it", b"?", b"</user>", b"<assistant>"]
    plan = plan_query(pieces, 3, last_user="Some long document. Who wrote it?", system="Be brief.")
    assert (plan.query_start, plan.query_end) == (10, 13)  # " wrote it ?": the question's end
    assert plan.head_end == 3  # through the system prompt
    tail = plan_query(pieces, 4)
    assert (tail.query_start, tail.query_end) == (11, 15)
    explicit = plan_query(pieces, 4, explicit=[7, 8])
    assert (explicit.query_start, explicit.query_end, explicit.extra_query) == (15, 17, (7, 8))


def test_drafter_steps_aside_for_interactive_work_and_redoes_aborted_chunks(deep_model):
    import threading
    import time

    tokens = prompt_tokens(deep_model, 400)
    reference = Drafter(deep_model, [1], 512, n_batch=64).run(tokens)
    busy = threading.Event()

    def on_progress(done: int) -> None:
        if done == 128:  # interactive work shows up while chunk 3 starts; it ends 0.3 s later
            busy.set()
            threading.Timer(0.3, busy.clear).start()

    t0 = time.monotonic()
    drafted = Drafter(deep_model, [1], 512, n_batch=64).run(tokens, progress=on_progress, should_yield=busy.is_set)
    assert time.monotonic() - t0 >= 0.3  # it waited for the interactive work
    np.testing.assert_array_equal(drafted.k[1], reference.k[1])  # aborted or not, every chunk once
    np.testing.assert_array_equal(drafted.q[1], reference.q[1])
