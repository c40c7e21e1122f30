"""The native scorer (ggml_ext/) against the numpy reference: random inputs, the demo model's
captures, non-finite inputs, the GPU-layer setting of a separate drafter."""
from __future__ import annotations

import numpy as np
import pytest

from pflash_plugin.llama import Model, native
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.pflash.pacing import Alone
from pflash_plugin.pflash.scorers import NumpyScorer, make_scorer
from pflash_plugin.pflash.attention_mass import attention_mass
from pflash_plugin.llama.capture import CaptureSpec

needs_native = pytest.mark.skipif(native.load() is None, reason="ggml_ext not built")


def random_qk(seed: int, n: int, n_head: int, n_head_kv: int, head_dim: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, n_head, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, n_head_kv, head_dim)).astype(np.float32)
    return q, k


@needs_native
@pytest.mark.parametrize(
    "n,n_head,n_head_kv,head_dim,query_start,query_end",
    [
        (23, 4, 2, 8, 17, 23),  # GQA 2
        (1001, 8, 1, 36, 990, 1001),  # MQA, odd length, head_dim not a multiple of the vector width
        (517, 6, 3, 20, 500, 509),  # a query that ends before the prompt does (template suffix after it)
        (2049, 32, 8, 128, 2041, 2049),  # the 8B-class shape, over several key chunks
        (300, 4, 4, 16, 1, 300),  # one key, 299 query rows (over the 32-row register tile)
    ],
)
def test_native_mass_equals_numpy(n, n_head, n_head_kv, head_dim, query_start, query_end):
    q, k = random_qk(n + head_dim, n, n_head, n_head_kv, head_dim)
    expected = attention_mass(q, k, query_start, query_end)
    got = native.attention_mass(q, k, query_start, query_end, n_threads=2)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-9)


@needs_native
@pytest.mark.parametrize("row,where,value",
                         [(60, "q", np.nan), (10, "k", np.inf), (10, "k", -np.inf), (3, "k", np.nan)])
def test_native_refuses_non_finite(row, where, value):
    q, k = random_qk(3, 64, 4, 2, 16)
    (q if where == "q" else k)[row, 1, 3] = value  # a query row (56..63) or a key row
    with pytest.raises(native.NativeError) as error:
        native.attention_mass(q, k, 56, 64)
    assert error.value.non_finite


@needs_native
def test_auto_scorer_is_native_when_built_and_numpy_when_asked():
    spec = CaptureSpec([1], 16, 4, 2)
    assert make_scorer(spec, "auto").name == "native-cpu"
    assert isinstance(make_scorer(spec, "numpy"), NumpyScorer)


@pytest.mark.demo
@needs_native
def test_native_equals_numpy_on_demo_model_captures(demo_model):
    from pflash_plugin.testing.haystack import needle_prompt

    model = Model(demo_model)
    prompt, _ = needle_prompt(1500, 0.5, seed=5)
    tokens = model.tokenize(prompt)
    start = len(tokens) - 8
    runs = {kind: Drafter(model, [5], len(tokens) + 8, DraftOptions(scorer=kind, n_threads=2))
            for kind in ("numpy", "native")}
    masses = {kind: drafter.run(tokens, start).mass for kind, drafter in runs.items()}
    for x, y in zip(runs["numpy"].scorer.tensors(5), runs["native"].scorer.tensors(5)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(masses["native"], masses["numpy"], rtol=1e-4, atol=1e-9)
    assert masses["native"].shape == (start,)


@pytest.mark.parametrize("setting,expected", [(None, 0), (7, 7)])
def test_separate_drafter_gpu_layers_reach_the_loaded_model(tiny_model, setting, expected):
    """pflash_drafter_gpu_layers (default: the target's n_gpu_layers) is what the drafter loads with."""
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.config.settings import ModelSettings
    from pflash_plugin.testing import cached_tiny_llama

    drafter_path = cached_tiny_llama(seed=11)  # same vocabulary, other weights
    served = ServedModel(ModelSettings(model=str(tiny_model), n_ctx=512, pflash="auto", verbose=False,
                                       pflash_drafter=str(drafter_path), pflash_drafter_gpu_layers=setting,
                                       pflash_drafter_cut=False))
    try:
        drafter = served.compression.compressor._drafter
        assert drafter.model.path == str(drafter_path) and drafter.model.n_gpu_layers == expected
        assert served.pflash_scorer == ("native-cpu" if native.load() is not None else "numpy")
    finally:
        served.close()


def test_stopping_the_worker_cancels_the_job_in_flight_then_frees_the_drafter(tiny_model, monkeypatch):
    """CompressionWorker.stop cancels the scoring under way (the drafter stops between chunks) and
    closes the drafter only once the thread is done with it."""
    import threading

    from pflash_plugin.pflash.compressor import CompressionJob, CompressionWorker, Compressor, PflashConfig
    from pflash_plugin.pflash.draft_lane import DraftLane
    from pflash_plugin.pflash.query import plan_query

    model = Model(tiny_model)
    tokens = (model.tokenize(" ".join(f"fact {i} about the river." for i in range(400))) * 4)[:1900]
    started, delivered = threading.Event(), []
    decode = DraftLane._decode_politely

    def slow(self, batch, job):
        started.set()
        threading.Event().wait(0.05)  # a slow chunk
        decode(self, batch, job)

    monkeypatch.setattr(DraftLane, "_decode_politely", slow)
    compressor = Compressor(
        PflashConfig(), model.piece, lambda: Drafter(model, [1], 2048, DraftOptions(n_batch=64)), persistent=True
    )
    worker = CompressionWorker(compressor)
    job = CompressionJob(tokens, plan_query(len(tokens), 8), 0.2)
    worker.submit(job, Alone(), delivered.append)
    assert started.wait(10)
    worker.stop()
    assert job.cancelled.is_set() and not delivered  # cancelled mid-way: 30 chunks would take 1.5 s
    assert compressor._drafter is None and not worker._thread.is_alive()
