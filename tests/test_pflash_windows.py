"""Windowed drafting: the plan of windows, and what the drafter captures with them (tiny models)."""
from __future__ import annotations

import numpy as np
import pytest

from pflash_plugin.llama import Model, native
from pflash_plugin.pflash.drafter import GPU_LANES, DraftOptions, Drafter, DrafterError, draft_lanes
from pflash_plugin.pflash.windows import DraftWindows, Stage
from pflash_plugin.testing import cached_tiny_llama


def test_short_prompts_are_one_causal_stage():
    windows = DraftWindows(window=256, sink=16, causal_max=1000)
    assert windows.stages(1000) == [Stage(0, 1000)]
    assert DraftWindows(window=0, causal_max=0).stages(50_000) == [Stage(0, 50_000)]
    assert DraftWindows(window=256, sink=16, causal_max=0).stages(272) == [Stage(0, 272)]  # sink + one window


@pytest.mark.parametrize("n", [273, 1000, 4096, 10_001])
def test_windows_cover_every_token_once_in_order_and_end_with_the_query(n):
    windows = DraftWindows(window=256, sink=16, causal_max=0)
    stages = windows.stages(n)
    assert stages[0].start == 0 and stages[-1].end == n and len(stages) > 1
    assert all(a.end == b.start for a, b in zip(stages, stages[1:]))
    assert all(s.end - s.start == 256 for s in stages[1:])  # whole windows, aligned to the end
    assert 16 < stages[0].end <= 16 + 256  # the sink and a first (shorter) window
    assert windows.context_tokens(n) == 16 + 256 < n


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match="below the drafter's ubatch"):
        DraftWindows(window=100).check(n_batch=512, max_tokens=32768)
    with pytest.raises(ValueError, match="exceed the longest prompt"):
        DraftWindows(window=4096, sink=64).check(n_batch=512, max_tokens=4096)
    DraftWindows(window=0).check(n_batch=512, max_tokens=100)
    DraftWindows(window=512).check(n_batch=512, max_tokens=32768)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(cached_tiny_llama(n_layer=4, seed=5))


def tokens_of(model: Model, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, model.n_vocab, n)]


WINDOWS = DraftWindows(window=128, sink=16, causal_max=0)  # 16 + 128 cells: llama.cpp's smallest context


def windowed_drafter(model: Model, windows: DraftWindows = WINDOWS) -> Drafter:
    return Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer="numpy", windows=windows))


def test_a_long_prompt_drafts_in_a_context_of_sink_plus_window(model):
    drafter = windowed_drafter(model)
    tokens = tokens_of(model, 1200)
    assert drafter.lead.ctx.n_ctx < 600  # were the windows' cells not freed, 1200 tokens would not fit
    result = drafter.run(tokens, 1190)
    assert result.windows == len(WINDOWS.stages(1200)) == 10
    k = drafter.scorer.tensors(2)[1]
    assert k.shape[0] == 1190 and np.isfinite(result.mass).all() and result.mass.shape == (1190,)


def test_a_token_outside_the_window_and_sink_changes_nothing_inside_it(model):
    drafter = windowed_drafter(model)
    stages = WINDOWS.stages(1000)
    base = tokens_of(model, 1000)
    changed_early = list(base)
    changed_early[stages[1].start + 5] ^= 1  # inside the second window
    changed_sink = list(base)
    changed_sink[3] ^= 1

    def captured_k(tokens: list[int]) -> np.ndarray:
        drafter.run(tokens, 990)
        return drafter.scorer.tensors(2)[1].copy()

    k_base, k_early, k_sink = captured_k(base), captured_k(changed_early), captured_k(changed_sink)
    late = slice(stages[3].start, stages[3].end)  # a later window
    second = slice(stages[1].start + 6, stages[1].end)
    np.testing.assert_array_equal(k_early[late], k_base[late])
    assert not np.allclose(k_early[second], k_base[second])  # the change does reach its own window
    assert not np.allclose(k_sink[late], k_base[late])  # and every window sees the sink


def test_one_window_over_the_whole_prompt_is_the_causal_draft(model):
    tokens = tokens_of(model, 600)
    causal = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer="numpy"))
    wide = windowed_drafter(model, DraftWindows(window=1024, sink=16, causal_max=0))
    a, b = causal.run(tokens, 590), wide.run(tokens, 590)
    assert a.windows == b.windows == 1
    for x, y in zip(causal.scorer.tensors(2), wide.scorer.tensors(2)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.mass, b.mass)


def test_windows_below_the_ubatch_are_refused(model):
    with pytest.raises(DrafterError, match="below the drafter's ubatch"):
        windowed_drafter(model, DraftWindows(window=32, sink=16, causal_max=0))


def test_the_default_window_applies_where_the_context_allows():
    assert DraftWindows.default(sink=64, causal_max=16384, max_tokens=131072).window == 2048
    assert DraftWindows.default(sink=64, causal_max=16384, max_tokens=2048).window == 0  # small servers: causal


def test_an_explicit_window_that_cannot_work_stops_the_server_at_start(tiny_model):
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.config.settings import ModelSettings

    settings = dict(model=str(tiny_model), n_ctx=1024, pflash="auto", verbose=False, n_threads=1, n_threads_batch=1)
    with pytest.raises(ValueError, match="pflash_drafter_window 100 is below"):
        ServedModel(ModelSettings(**settings, pflash_drafter_window=100))
    with pytest.raises(ValueError, match="exceed the longest prompt"):
        ServedModel(ModelSettings(**settings, pflash_drafter_window=4096))


NATIVE = native.load() is not None
SCORERS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="ggml_ext not built"))]


def draft(model: Model, tokens: list[int], scorer: str):
    drafter = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer=scorer, windows=WINDOWS))
    result = drafter.run(tokens, len(tokens) - 10)
    q, k = (x.copy() for x in drafter.scorer.tensors(2))
    drafter.close()
    return result, q, k


def test_the_drafter_ubatch_is_a_server_setting(tiny_model):
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.config.settings import ModelSettings

    settings = dict(model=str(tiny_model), n_ctx=1024, pflash="auto", verbose=False, n_threads=1, n_threads_batch=1,
                    pflash_drafter_window=256, pflash_drafter_sink=16, pflash_drafter_causal_max=0)
    served = ServedModel(ModelSettings(**settings, pflash_drafter_ubatch=272))
    try:
        drafter = served.compression.compressor._drafter
        assert drafter is not None and drafter.n_batch == drafter.lead.ctx.n_batch == 272
    finally:
        served.close()
    with pytest.raises(ValueError, match="below the drafter's ubatch"):
        ServedModel(ModelSettings(**settings, pflash_drafter_ubatch=273))


@pytest.mark.parametrize("scorer", SCORERS)
def test_a_layout_that_does_not_cover_the_ubatch_is_a_capture_error(model, scorer):
    from pflash_plugin.llama import Batch

    drafter = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer=scorer, windows=WINDOWS))
    batch = Batch(64, 1)
    try:
        drafter.scorer.begin(40, 48)
        drafter.scorer.layout([(0, 30), (30, 10)])  # 40 rows laid out for a ubatch of 48
        batch.add_sequence(tokens_of(model, 48), 0, 0, False)
        drafter.lead.ctx.decode(batch)
        assert "layout covers 40 rows" in (drafter.scorer.error() or "")
    finally:
        batch.close()
        drafter.close()


@pytest.mark.parametrize("scorer", SCORERS)
def test_a_pinned_kv_view_reuses_the_graph_and_scores_the_same(model, scorer):
    # windows of 512 in ubatches of 128: unpinned, a window's ubatches see 256, 512, 512 and 768 cells
    # (llama.cpp rounds the cells in use up to 256), so only the third reuses the graph of the one
    # before; pinned, all see 768 and only the first rebuilds (after the K shift of the sink's cell)
    windows = DraftWindows(window=512, sink=16, causal_max=0)
    tokens = tokens_of(model, 3000, seed=3)
    n_windows = len(windows.stages(3000)) - 1
    runs = {}
    for pin in (False, True):
        drafter = Drafter(model, [2], 4096, DraftOptions(n_batch=128, scorer=scorer, windows=windows,
                                                         pin_window_view=pin))
        try:
            result = drafter.run(tokens, 2990)
            reuses = drafter.graph_reuses
            again = drafter.run(tokens, 2990)  # the pin survives a run
            causal = drafter.run(tokens[:100], 90)  # a prompt no window applies to
            runs[pin] = (result.mass, again.mass, causal.mass, reuses, drafter.lead.pinned)
        finally:
            drafter.close()
    (mass, _, short, reuses, pinned), (pin_mass, pin_again, pin_short, pin_reuses, pin_pinned) = runs[False], runs[True]
    assert (pinned, pin_pinned) == (False, True) and n_windows == 5
    assert reuses <= n_windows + 1 and pin_reuses >= 3 * n_windows
    np.testing.assert_allclose(pin_mass, mass, rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(pin_again, pin_mass)
    np.testing.assert_allclose(pin_short, short, rtol=1e-4, atol=1e-7)


def test_the_pin_is_on_where_the_drafter_is_on_a_gpu_and_only_for_windows(model):
    from pflash_plugin.llama.devices import gpu_count

    default = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer="numpy", windows=WINDOWS))
    causal = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer="numpy", pin_window_view=True))
    try:
        assert default.lead.pinned == (model.n_gpu_layers != 0 and gpu_count() > 0)
        assert not causal.lead.pinned
    finally:
        for drafter in (default, causal):
            drafter.close()


@pytest.mark.parametrize("pin, pinned, lanes", [("on", True, 1), ("off", False, 2)])
def test_the_pin_and_lanes_are_server_settings(tiny_model, pin, pinned, lanes):
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.config.settings import ModelSettings

    served = ServedModel(ModelSettings(model=str(tiny_model), n_ctx=1024, pflash="auto", verbose=False, n_threads=1,
                                       n_threads_batch=1, pflash_drafter_window=256, pflash_drafter_sink=16,
                                       pflash_drafter_causal_max=0, pflash_drafter_ubatch=128,
                                       pflash_drafter_pin_view=pin, pflash_drafter_lanes=lanes))
    try:
        drafter = served.compression.compressor._drafter
        assert drafter is not None and drafter.lead.pinned is pinned and len(drafter.lanes) == lanes - 1
    finally:
        served.close()


def test_lanes_by_default_only_where_windows_are_drafted_on_a_gpu():
    windowed, causal = DraftWindows(window=2048, sink=64), DraftWindows(window=0)
    assert draft_lanes(None, True, windowed) == GPU_LANES > 1
    assert draft_lanes(None, False, windowed) == 1  # a CPU: one context keeps its cores busy
    assert draft_lanes(None, True, causal) == draft_lanes(3, True, causal) == 1  # no windows to share
    assert draft_lanes(2, False, windowed) == 2  # asked for
    # the memory of GPU_LANES contexts would leave no KV pool of max_ctx: as many as leave one
    assert draft_lanes(None, True, windowed, fits=lambda lanes: lanes <= 2) == 2
    assert draft_lanes(None, True, windowed, fits=lambda lanes: False) == 1
    assert draft_lanes(6, True, windowed, fits=lambda lanes: False) == 6  # asked for: the pool check refuses it


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("lanes", [2, 3])
def test_windows_drafted_in_lanes_score_as_one_context(model, scorer, lanes):
    # 1200 tokens: a first stage, then 9 windows dealt round-robin to `lanes` contexts on threads;
    # each lane decodes the sink again (capturing nothing) and captures its windows' rows into the
    # lead's stores, so the mass covers every token once
    tokens = tokens_of(model, 1200, seed=11)
    serial, q0, k0 = draft(model, tokens, scorer)
    drafter = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer=scorer, windows=WINDOWS, lanes=lanes))
    seen: list[int] = []
    try:
        assert len(drafter.lanes) == lanes - 1 and all(lane.ctx.n_ctx < 600 for lane in drafter.lanes)
        laned = drafter.run(tokens, len(tokens) - 10, progress=seen.append)
        q1, k1 = (x.copy() for x in drafter.scorer.tensors(2))
        again = drafter.run(tokens, len(tokens) - 10)
        short = drafter.run(tokens[:300], 290)  # 2 windows: one lane has none; earlier rows must not count
    finally:
        drafter.close()
    alone_short, _, _ = draft(model, tokens[:300], scorer)
    np.testing.assert_allclose(short.mass, alone_short.mass, rtol=1e-3, atol=1e-6)
    assert laned.windows == serial.windows == 10 and seen[-1] == len(tokens) == max(seen)
    np.testing.assert_allclose(k1, k0, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(q1, q0, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(laned.mass, serial.mass, rtol=1e-3, atol=1e-6)
    np.testing.assert_array_equal(again.mass, laned.mass)


@pytest.mark.parametrize("scorer", SCORERS)
def test_a_cancel_stops_every_lane_and_the_drafter_drafts_again(model, scorer):
    from pflash_plugin.pflash.draft_lane import Cancelled

    tokens = tokens_of(model, 1200, seed=12)
    drafter = Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer=scorer, windows=WINDOWS, lanes=3))
    calls = []

    def stop_after_a_few() -> bool:
        calls.append(1)
        return len(calls) > 6

    try:
        with pytest.raises(Cancelled):
            drafter.run(tokens, 1190, should_stop=stop_after_a_few)
        after = drafter.run(tokens, 1190)
    finally:
        drafter.close()
    alone, _, _ = draft(model, tokens, scorer)
    np.testing.assert_allclose(after.mass, alone.mass, rtol=1e-3, atol=1e-6)


def test_lanes_need_windows(model):
    with pytest.raises(DrafterError, match="pflash_drafter_lanes"):
        Drafter(model, [2], 2048, DraftOptions(n_batch=64, scorer="numpy", lanes=2))
