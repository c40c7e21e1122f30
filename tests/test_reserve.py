"""The drafter's memory reserve: the formula covers measured peaks; the pool leaves it free."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from types import SimpleNamespace

from pflash_plugin.engine.loader import EngineConfig, MemoryBudget, MemoryReserveError, pool_fits, pool_tokens

_MEASURE = r"""
import json, sys
from pflash_plugin.llama import Model
from pflash_plugin.pflash.compressor import CompressionJob, Compressor, PflashConfig
from pflash_plugin.pflash.drafter import DraftOptions, Drafter, scoring_layers
from pflash_plugin.pflash.query import plan_query
from pflash_plugin.pflash.reserve import drafter_reserve
from pflash_plugin.pflash.windows import DraftWindows
from pflash_plugin.testing.haystack import needle_prompt

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path, n, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
windows = DraftWindows(window, 64, causal_max=0)
model = Model(path, use_mmap=False)  # weights resident before the baseline
tokens = model.tokenize(needle_prompt(n, 0.5, 1)[0])[:n]
layers = scoring_layers(model, None)
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
options = DraftOptions(n_batch=512, windows=windows)
compressor = Compressor(PflashConfig(), model.piece, lambda: Drafter(model, layers, n, options), persistent=False)
report = compressor.compress(CompressionJob(tokens, plan_query(len(tokens), 8), 0.2)).report
reserve = drafter_reserve(model, layers, 512, separate_weights=False)
formula = reserve.bytes_for(n, windows.context_tokens(n))
print(json.dumps({"peak": status("VmHWM:") - base, "formula": formula, "status": report.status}))
"""


def measure(model_path, n_tokens: int, window: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(model_path), str(n_tokens), str(window)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.demo
def test_reserve_formula_covers_measured_drafter_peaks(demo_model):
    small, large = measure(demo_model, 1024), measure(demo_model, 4096)
    assert small["status"] == large["status"] == "compressed"
    for m in (small, large):
        assert m["peak"] <= m["formula"], m
    # per token too: the formula's slope is not below the measured one
    assert (large["peak"] - small["peak"]) / 3072 <= (large["formula"] - small["formula"]) / 3072


def test_reserve_formula_covers_measured_tiny_drafter_peak(tiny_model):
    m = measure(tiny_model, 2048)
    assert m["peak"] <= m["formula"], m


def test_windowed_drafter_reserves_kv_for_its_window_only_and_still_covers_its_peak(tiny_model):
    causal, windowed = measure(tiny_model, 4096), measure(tiny_model, 4096, window=512)
    assert windowed["status"] == "compressed" and windowed["peak"] <= windowed["formula"], windowed
    assert windowed["formula"] < causal["formula"]


def test_each_drafter_lane_reserves_a_context_of_its_window(tiny_model):
    from pflash_plugin.llama import Model
    from pflash_plugin.pflash.reserve import COMPUTE_BYTES_PER_UBATCH_TOKEN, GPU_FIXED_BYTES, drafter_reserve

    model = Model(str(tiny_model))
    try:
        one = drafter_reserve(model, [1], 512, False, gpu=True)
        three = drafter_reserve(model, [1], 512, False, gpu=True, lanes=3, lane_cells=2112)
        lane = COMPUTE_BYTES_PER_UBATCH_TOKEN * 512 + GPU_FIXED_BYTES + model.kv_bytes_per_token() * 2112
        assert three.fixed_bytes - one.fixed_bytes == 2 * lane
        assert (three.per_token_bytes, three.kv_bytes_per_token) == (one.per_token_bytes, one.kv_bytes_per_token)
    finally:
        model.close()


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"n_slots": 4, "max_ctx": 1000, "page_size": 10, **kw})


def test_pool_without_reserve_is_slots_times_max_ctx_or_explicit():
    # a slot's max_ctx in whole llama.cpp KV streams (256 cells), so that each slot can have its own
    assert pool_tokens(config(), 100) == 4 * 1024 + 4  # whole pages of 10
    assert pool_tokens(config(max_ctx=1024, page_size=32), 100) == 4096
    assert pool_tokens(config(kv_pool_tokens=1234), 100) == 1240  # whole pages


def test_automatic_pool_shrinks_to_leave_the_reserve_free():
    # 300,000 bytes available, 50,000 reserved, 100 bytes/token: 2,500 tokens fit
    assert pool_tokens(config(), 100, MemoryBudget(50_000, 300_000)) == 2500


def test_explicit_pool_that_eats_the_reserve_is_refused_with_what_fits():
    with pytest.raises(MemoryReserveError, match="at most 2500 tokens fit"):
        pool_tokens(config(kv_pool_tokens=3000), 100, MemoryBudget(50_000, 300_000))
    assert pool_tokens(config(kv_pool_tokens=2000), 100, MemoryBudget(50_000, 300_000)) == 2000


def test_pool_counts_only_the_kv_share_on_the_drafters_gpu():
    # a target split by layers keeps half of each token's KV (50 of 100 bytes) on the drafter's
    # GPU: twice the tokens of a single GPU fit beside the reserve
    half = MemoryBudget(50_000, 300_000, kv_share=0.5)
    assert pool_tokens(config(kv_pool_tokens=5000), 100, half) == 5000
    with pytest.raises(MemoryReserveError, match="at most 5000 tokens fit"):
        pool_tokens(config(kv_pool_tokens=5010), 100, half)


def test_reserve_that_leaves_less_than_max_ctx_is_refused():
    with pytest.raises(MemoryReserveError, match="less than max_ctx"):
        pool_tokens(config(), 100, MemoryBudget(250_000, 300_000))
    # what the drafter's default lanes are chosen by: a pool pool_tokens takes, or none
    assert not pool_fits(config(), 100, MemoryBudget(250_000, 300_000))
    assert pool_fits(config(), 100, MemoryBudget(200_000, 300_000))  # 1,000 tokens: max_ctx
    assert not pool_fits(config(kv_pool_tokens=3000), 100, MemoryBudget(50_000, 300_000))


def test_server_refuses_an_explicit_pool_that_eats_the_reserve(tiny_model):
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.config.settings import ModelSettings

    with pytest.raises(MemoryReserveError, match="tokens fit"):
        ServedModel(ModelSettings(model=str(tiny_model), n_ctx=512, pflash="auto", kv_pool_tokens=10**9, verbose=False))


def test_gpu_reserve_adds_the_measured_device_overhead(tiny_model):
    from pflash_plugin.llama import Model
    from pflash_plugin.pflash.reserve import GPU_FIXED_BYTES, drafter_reserve

    model = Model(tiny_model)
    cpu, gpu = drafter_reserve(model, [0], 512, False), drafter_reserve(model, [0], 512, False, gpu=True)
    assert gpu.fixed_bytes - cpu.fixed_bytes == GPU_FIXED_BYTES and gpu.per_token_bytes == cpu.per_token_bytes
    # the H200 probe (bench/gpu/probe.py): 12-layer 1024-wide model, peaks at 2K/8K/32K tokens
    measured = {2048: 230_686_720, 8192: 243_269_632, 32768: 570_425_344}
    wide = SimpleNamespace(n_layer=12, n_head=16, n_head_kv=4, head_dim=lambda: 64, size_bytes=0,
                           kv_bytes_per_token=lambda: 12 * 4 * 64 * 2 * 2)
    reserve = drafter_reserve(wide, [4], 512, False, gpu=True)
    assert all(peak <= reserve.bytes_for(n) for n, peak in measured.items())
