"""Drafter capture, scoring on captured tensors, startup guards and fallbacks (tiny models)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from pflash_plugin.llama import Model, native
from pflash_plugin.pflash.compressor import CompressionJob, Compressor, PflashConfig
from pflash_plugin.pflash.drafter import DraftOptions, Drafter, DrafterError, check_vocab, scoring_layers
from pflash_plugin.pflash.pacing import Pacing
from pflash_plugin.pflash.query import plan_query
from pflash_plugin.testing import cached_tiny_llama


@pytest.fixture(scope="module")
def deep_model() -> Model:
    return Model(cached_tiny_llama(n_layer=4, seed=3))


def prompt_tokens(model: Model, n: int) -> list[int]:
    text = " ".join(f"line {i} tells the story of the river and the old bridge." for i in range(n))
    return model.tokenize(text)[:n]


NATIVE = native.load() is not None
SCORERS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="ggml_ext not built"))]


@pytest.mark.parametrize("scorer", SCORERS)
def test_post_rope_is_a_rotation_of_pre_rope(deep_model, scorer):
    tokens = prompt_tokens(deep_model, 96)
    post = Drafter(deep_model, [1], 128, DraftOptions("post", scorer=scorer))
    pre = Drafter(deep_model, [1], 128, DraftOptions("pre", scorer=scorer))
    post.run(tokens, 88), pre.run(tokens, 88)
    (q_post, k_post), (q_pre, k_pre) = post.scorer.tensors(1), pre.scorer.tensors(1)
    # position 0 is rotated by angle 0; every later position keeps its norm but not its values
    np.testing.assert_allclose(k_post[0], k_pre[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(k_post, axis=-1), np.linalg.norm(k_pre, axis=-1), rtol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(q_post, axis=-1), np.linalg.norm(q_pre, axis=-1), rtol=1e-4)
    assert not np.allclose(k_post[10:], k_pre[10:]) and not np.allclose(q_post, q_pre)
    assert q_post.shape == (8, 4, 16) and k_post.shape == (88, 2, 16)


@pytest.mark.parametrize("scorer", SCORERS)
def test_capture_stops_after_last_scoring_layer_and_matches_full_forward(deep_model, scorer):
    tokens = prompt_tokens(deep_model, 200)
    early = Drafter(deep_model, [1], 256, DraftOptions(n_batch=64, scorer=scorer))  # 4 ubatches
    late = Drafter(deep_model, [1, 3], 256, DraftOptions(n_batch=64, scorer=scorer))  # runs to the last layer
    a, b = early.run(tokens, 190), late.run(tokens, 190)
    assert early.scorer.ubatches_stopped() == 4
    assert (a.layers_run, b.layers_run) == (2, 4)
    assert a.scorer == ("numpy" if scorer == "numpy" else "native-cpu")
    # stopping each ubatch early leaves the layers below intact: the same K as the full forward
    for x, y in zip(early.scorer.tensors(1), late.scorer.tensors(1)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="ggml_ext not built")
@pytest.mark.parametrize("rope", ["post", "pre"])
def test_native_callback_stops_at_the_same_node_and_captures_the_same_qk(deep_model, rope):
    tokens = prompt_tokens(deep_model, 150)
    drafters = {kind: Drafter(deep_model, [1, 2], 256, DraftOptions(rope, n_batch=64, scorer=kind))
                for kind in ("numpy", "native")}
    results = {kind: d.run(tokens, 141, 149) for kind, d in drafters.items()}
    py, c = drafters["numpy"].scorer, drafters["native"].scorer
    assert py.capture.result.nodes_seen == c.capture.stats()["nodes_seen"] > 0  # the same node ends each graph
    assert py.ubatches_stopped() == c.ubatches_stopped() == 3
    for layer in (1, 2):
        for x, y in zip(py.tensors(layer), c.tensors(layer)):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(results["native"].mass, results["numpy"].mass, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("scorer", SCORERS)
def test_scoring_matches_float64_on_captured_tensors(deep_model, scorer):
    tokens = prompt_tokens(deep_model, 80)
    drafter = Drafter(deep_model, [2], 128, DraftOptions(scorer=scorer))
    start = 72
    drafted = drafter.run(tokens, start)
    q, k = (x.astype(np.float64) for x in drafter.scorer.tensors(2))
    expected = np.zeros(start)
    group = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        for t in range(len(q)):
            logits = [float(q[t, h] @ k[j, h // group]) / math.sqrt(q.shape[2]) for j in range(start)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            expected += np.array(weights) / total
    expected /= q.shape[1] * len(q)
    np.testing.assert_allclose(drafted.mass, expected, rtol=1e-4, atol=1e-7)


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
    """Fault injection: a query row of the capture turns NaN before it is scored."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, DraftOptions(scorer="numpy"), **kw)
        score = self.scorer.mass

        def corrupted():
            self.scorer.capture.result.q[1][-1][-1, 0, 0] = np.nan
            return score()

        self.scorer.mass = corrupted


def test_non_finite_scores_fall_back_to_full_prefill(deep_model):
    tokens = prompt_tokens(deep_model, 200)
    compressor = Compressor(PflashConfig(segment_min=4, segment_max=16), deep_model.piece,
                            lambda: _NaNDrafter(deep_model, [1], 256), persistent=False)
    plan = plan_query(len(tokens), 8)
    result = compressor.compress(CompressionJob(tokens, plan, 0.3))
    assert result.report.status == "fallback" and "non-finite" in result.report.reason
    assert result.tokens == tokens


def test_compressor_keeps_budget_head_and_query(deep_model):
    tokens = prompt_tokens(deep_model, 400)
    compressor = Compressor(PflashConfig(segment_min=4, segment_max=16), deep_model.piece,
                            lambda: Drafter(deep_model, [1], 512), persistent=True)
    plan = plan_query(len(tokens), 8, min_head=4)
    result = compressor.compress(CompressionJob(tokens, plan, 0.25))
    report = result.report
    assert report.status == "compressed"
    assert len(result.tokens) == report.kept_tokens <= 100
    assert result.tokens[:4] == tokens[:4] and result.tokens[-8:] == tokens[-8:]
    assert report.segments_kept < report.segments_total and report.layers_run == 2
    # a budget smaller than the mandatory spans: no compression
    head_too_long = plan_query(len(tokens), 8, min_head=200)
    skipped = compressor.compress(CompressionJob(tokens, head_too_long, 0.25))
    assert skipped.report.status == "skipped" and skipped.tokens == tokens


def test_plan_query_finds_the_last_user_message():
    pieces = [b"<s>", b"<sys>", b"Be brief.", b"</sys>", b"<user>", b"Some", b" long", b" document", b".", b" Who",
              b" wrote", b" it", b"?", b"</user>", b"<assistant>"]
    plan = plan_query(len(pieces), 3, pieces=pieces, last_user="Some long document. Who wrote it?", system="Be brief.")
    assert (plan.query_start, plan.query_end) == (10, 13)  # " wrote it ?": the question's end
    assert plan.head_end == 3  # through the system prompt
    tail = plan_query(len(pieces), 4, pieces=pieces)
    assert (tail.query_start, tail.query_end) == (11, 15)
    explicit = plan_query(len(pieces), 4, explicit=[7, 8])
    assert (explicit.query_start, explicit.query_end, explicit.extra_query) == (15, 17, (7, 8))


class _YieldAfter:
    """interactive_waiting that turns true for calls [first, last): the drafter's pre-decode check is call
    1, then llama.cpp polls it as its abort callback while a chunk computes."""

    def __init__(self, first: int, last: int) -> None:
        self.calls, self.first, self.last = 0, first, last

    def __call__(self) -> bool:
        self.calls += 1
        return self.first <= self.calls < self.last


@pytest.mark.parametrize("scorer", SCORERS)
def test_drafter_aborts_a_chunk_for_interactive_work_and_redoes_it(deep_model, scorer):
    tokens = prompt_tokens(deep_model, 400)
    reference = Drafter(deep_model, [1], 512, DraftOptions(n_batch=64, scorer=scorer))
    expected = reference.run(tokens, 392)
    drafter = Drafter(deep_model, [1], 512, DraftOptions(n_batch=64, scorer=scorer))
    yield_now = _YieldAfter(5, 40)  # true while the first chunk computes: llama.cpp aborts it
    neighbours = SimpleNamespace(interactive_waiting=yield_now, slots_decoding=lambda: False)
    drafted = drafter.run(tokens, 392, pacing=Pacing(neighbours))
    assert drafter.lead.aborted_chunks >= 1 and yield_now.calls > 40
    # rolled back and redone: the same captures and scores as an undisturbed run
    for x, y in zip(drafter.scorer.tensors(1), reference.scorer.tensors(1)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(drafted.mass, expected.mass)


def test_drafter_shares_the_device_with_decoding_slots(deep_model, monkeypatch):
    """While slots decode: chunks of at most SHARED_CHUNK tokens, each followed by a pause that
    leaves the device to them for (1 / shared_duty - 1) of the chunk's time; same scores."""
    import pflash_plugin.pflash.draft_lane as draft_lane

    tokens = prompt_tokens(deep_model, 1200)
    alone, shared = [], []
    solo = Drafter(deep_model, [1], 1300, DraftOptions(n_batch=1024, shared_duty=0.25))
    expected = solo.run(tokens, 1190, progress=alone.append)
    pauses: list[float] = []
    monkeypatch.setattr(draft_lane.time, "sleep", pauses.append)
    decoding = SimpleNamespace(interactive_waiting=lambda: False, slots_decoding=lambda: True)
    got = solo.run(tokens, 1190, progress=shared.append, pacing=Pacing(decoding))
    assert alone == [1024, 1200] and shared == [512, 1024, 1200]
    assert len(pauses) == 3 and all(p > 0 for p in pauses)  # 3x each chunk's time at duty 0.25
    np.testing.assert_allclose(got.mass, expected.mass, rtol=1e-4, atol=1e-9)


def test_a_draft_past_its_bound_no_longer_steps_aside(deep_model, monkeypatch):
    """Neighbours that always wait for a first token and always decode: a prompt that arrived
    longer ago than the bound drafts as if alone (full chunks, no pause, no abort), one within it
    steps aside until the bound passes and then does the same; the scores are the same."""
    import pflash_plugin.pflash.draft_lane as draft_lane

    tokens = prompt_tokens(deep_model, 1200)
    drafter = Drafter(deep_model, [1], 1300, DraftOptions(n_batch=1024, shared_duty=0.25))
    expected = drafter.run(tokens, 1190)
    busy = SimpleNamespace(interactive_waiting=lambda: True, slots_decoding=lambda: True)
    now = [100.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the drafter's waits move the injected clock
        waits.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(draft_lane.time, "sleep", sleep)
    late, chunks = Pacing(busy, started=now[0] - 3.0, bound_s=2.0, clock=lambda: now[0]), []
    got = drafter.run(tokens, 1190, progress=chunks.append, pacing=late)
    assert chunks == [1024, 1200] and waits == [] and drafter.lead.aborted_chunks == 0
    np.testing.assert_allclose(got.mass, expected.mass, rtol=1e-4, atol=1e-9)

    fresh, chunks = Pacing(busy, started=now[0], bound_s=2.0, clock=lambda: now[0]), []
    got = drafter.run(tokens, 1190, progress=chunks.append, pacing=fresh)
    assert now[0] - fresh.started == pytest.approx(2.0, abs=0.01)  # stepped aside up to the bound, no longer
    assert chunks == [1024, 1200]  # then as if alone
    np.testing.assert_allclose(got.mass, expected.mass, rtol=1e-4, atol=1e-9)


def test_pieces_read_as_piece_reads_them_and_media_ids_are_empty(deep_model):
    """Model.pieces, the PFlash plan's reading of a prompt (one dict lookup a token where all are
    cached), gives what `piece` gives, before and after the tokens are cached; a media pseudo-id
    (negative) reads as no text."""
    tokens = [5, 900, 17, 5, 1200]
    fresh = deep_model.pieces(tokens)  # some not cached yet: the one-by-one path
    assert fresh == [deep_model.piece(t) for t in tokens] == deep_model.pieces(tokens)
    assert deep_model.pieces([-3, 17]) == [b"", deep_model.piece(17)]


def test_detokenize_reads_as_piece_reads_and_refuses_an_id_outside_the_vocabulary(deep_model):
    """Model.detokenize (a token-id prompt's text, /detokenize) joins what `piece` gives, cached or
    not; an id outside the vocabulary raises as `piece` does (llama.cpp would abort on it)."""
    tokens = [7, 1300, 42, 7]
    expected = b"".join(deep_model.piece(t) for t in tokens).decode("utf-8", errors="replace")
    assert deep_model.detokenize([11, 1301]) == (deep_model.piece(11) + deep_model.piece(1301)).decode(
        "utf-8", errors="replace")
    assert deep_model.detokenize(tokens) == expected == deep_model.detokenize(tokens)
    for bad in (-1, deep_model.n_vocab):
        with pytest.raises(ValueError, match="not in the vocabulary"):
            deep_model.detokenize([7, bad])
