"""A drafter GGUF cut after its last scoring layer: same scores, fewer layers, written once."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pflash_plugin.llama import Model
from pflash_plugin.llama.gguf_cut import cached_cut, cut_layers
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.testing import cached_tiny_llama


@pytest.fixture(scope="module")
def deep_path():
    return cached_tiny_llama(n_layer=4, seed=3)


def mass(model: Model, layer: int, tokens: list[int]) -> np.ndarray:
    drafter = Drafter(model, [layer], len(tokens), DraftOptions(n_batch=64, scorer="numpy"))
    try:
        return drafter.run(tokens, len(tokens) - 8).mass
    finally:
        drafter.close()


def test_cut_copy_keeps_the_first_layers_and_scores_exactly_as_the_whole_model(deep_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut_layers(deep_path, cut, 2)
    names = [t.name for t in gguf.GGUFReader(cut).tensors]
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"0", "1"}
    assert "token_embd.weight" in names and "output_norm.weight" in names
    whole, short = Model(deep_path), Model(cut)
    assert (whole.n_layer, short.n_layer) == (4, 2)
    tokens = whole.tokenize(" ".join(f"line {i} says the river is cold." for i in range(60)))[:200]
    np.testing.assert_array_equal(mass(whole, 1, tokens), mass(short, 1, tokens))


def test_cut_refuses_a_layer_count_it_cannot_cut_to(deep_path, tmp_path):
    for n in (0, 4):
        with pytest.raises(ValueError, match=f"to {n} layers"):
            cut_layers(deep_path, tmp_path / "x.gguf", n)


def test_cache_writes_once_per_source_version(deep_path, tmp_path):
    source = tmp_path / "drafter.gguf"
    source.write_bytes(deep_path.read_bytes())
    first = cached_cut(source, 2, tmp_path / "cache")
    assert first is not None and first.exists()
    written = first.stat().st_mtime_ns
    assert cached_cut(source, 2, tmp_path / "cache") == first and first.stat().st_mtime_ns == written
    os.utime(source, ns=(written + 10**9, written + 10**9))  # a changed source: a new copy
    second = cached_cut(source, 2, tmp_path / "cache")
    assert second is not None and second != first and Model(second).n_layer == 2


def test_temporary_copies_of_dead_writers_are_removed_at_start(deep_path, tmp_path):
    """Issue 22: a SIGKILL during the first start left a complete 207 MB `*.gguf.<pid>.tmp`."""
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = cache / f"drafter-0123456789abcdef-2l.gguf.{dead.pid}.tmp"
    writing = cache / f"drafter-fedcba9876543210-2l.gguf.{os.getpid()}.tmp"  # a live writer's
    left.write_bytes(b"x" * 1000)
    writing.write_bytes(b"x")
    assert cached_cut(deep_path, 2, cache) is not None
    assert not left.exists() and writing.exists()


def test_unwritable_cache_falls_back_to_the_whole_model(deep_path, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert cached_cut(deep_path, 2, blocker / "cache") is None
    assert "loading the whole drafter" in caplog.text


def test_server_loads_the_cut_drafter_unless_told_not_to(tiny_model, deep_path, tmp_path):
    """--pflash_drafter with scoring layer 1 of 4 loads a 2-layer copy from pflash_cache_dir."""
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.config.settings import ModelSettings

    for cut, layers in ((True, 2), (False, 4)):
        served = ServedModel(ModelSettings(model=str(tiny_model), n_ctx=512, pflash="auto", verbose=False,
                                           pflash_drafter=str(deep_path), pflash_layers=[1],
                                           pflash_drafter_cut=cut, pflash_cache_dir=str(tmp_path)))
        try:
            model = served.compression.compressor._drafter.model
            assert model.n_layer == layers and served.drafter_file == model.path  # on /status
            assert model.path.startswith(str(tmp_path)) == cut
        finally:
            served.close()


def test_per_layer_metadata_is_cut_with_the_layers(tmp_path):
    """llama.cpp checks a per-layer array's length against block_count: the cut shortens it."""
    arrays = cached_tiny_llama(n_layer=4, seed=3, per_layer_kv_heads=True)
    assert Model(arrays).n_layer == 4  # the source loads with its 4-entry array
    cut = tmp_path / "cut.gguf"
    cut_layers(arrays, cut, 2)
    assert list(gguf.GGUFReader(cut).fields["llama.attention.head_count_kv"].contents()) == [2, 2]
    assert Model(cut).n_layer == 2
