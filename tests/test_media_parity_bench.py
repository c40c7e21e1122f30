"""bench/gpu/media_parity.py on the CPU (issue 46's parity target; the lead runs it on the H200):
for every tiny projector kind the batched engine's greedy tokens and top-k logprobs equal llama.cpp's
own media path (mtmd_helper_eval_chunks) within 1e-5, and a fault in the engine's media path (a
non-causal image decoded causally) is a mismatch with exit status 1."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from report_pages import bench_module

import pflash_plugin.llama.media as media
from pflash_plugin.llama.media import mtmd_available

if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
    pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)", allow_module_level=True)


def test_every_projector_kind_matches_llama_cpps_own_path(tmp_path: Path):
    out = tmp_path / "parity.json"
    # servers.sh's arguments are taken (and not used): the script is one line of bench/gpu/queue.sh
    args = ["--n_gpu_layers", "0", "--tokens", "8", "--out", str(out), "--target", "x.gguf", "--drafter", "none",
            "--llama-server", "none"]
    assert bench_module("gpu/media_parity.py").main(args) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and not data["on_gpu"] and data["tolerance"] == 1e-5
    assert [row["kind"] for row in data["rows"]] == ["mlp", "gemma3", "qwen2vl", "qwen2a"]
    for row in data["rows"]:
        for arm in ("media", "text"):
            r = row[arm]
            assert r["ok"] and r["tokens_equal"] and r["tokens"] == r["reference"] and len(r["tokens"]) == 8
            assert r["max_abs_first"] <= r["max_abs"] <= 1e-5
    assert data["rows"][3]["prompt_tokens"] > 750  # the audio clip's 750 tokens are in the prompt


def test_a_fault_in_the_engines_media_path_is_a_mismatch(tmp_path: Path, monkeypatch):
    """Gemma 3's image decoded with causal attention on (libmtmd's own path turns it off):
    the media arm is off, the text arm beside it is not, and the exit status says so."""
    monkeypatch.setattr(media.C, "llama_set_causal_attn", lambda ctx, causal: None)
    out = tmp_path / "parity.json"
    bench = bench_module("gpu/media_parity.py")
    assert bench.main(["--kinds", "gemma3", "--n_gpu_layers", "0", "--out", str(out)]) == 1
    [row] = json.loads(out.read_text())["rows"]
    assert not row["media"]["ok"] and row["media"]["max_abs"] > 1e-4 and row["text"]["ok"]
