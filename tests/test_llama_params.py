"""Every stock llama_cpp.server model key is applied to llama.cpp or refused at start (llama_params.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from llama_cpp.server.settings import ModelSettings as StockModelSettings

from pflash_plugin.engine.loader import build_engine
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams
from pflash_plugin.llama import Batch, Context, ContextConfig, Model
from pflash_plugin.server.config.llama_params import ALWAYS_SO, REFUSED, ModelPlan, SettingsRefused, plan, resolve
from pflash_plugin.server.runtime.models import ServedModel
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.testing import cached_tiny_llama
from pflash_plugin.llama.tiny_gguf import write_tiny_lora

# a value other than the default for every stock key whose type alone does not give one
SAMPLES: dict[str, Any] = {
    "model": "other.gguf",
    "model_alias": "other",
    "tensor_split": [0.5, 0.5],
    "kv_overrides": ["llama.context_length=int:1234"],
    "rpc_servers": "10.0.0.1:50052",
    "seed": 7,
    "numa": True,
    "chat_format": "chatml",
    "chat_template_kwargs": {"enable_thinking": False},
    "cache_type": "disk",
    "hf_tokenizer_config_path": "tokenizer_config.json",
    "hf_pretrained_model_name_or_path": "org/model",
    "hf_model_repo_id": "org/model",
    "draft_model": "prompt-lookup-decoding",
    "lora_base": "base.gguf",
    "type_k": 1,
    "type_v": 1,
    "flash_attn": True,  # ours defaults to None (llama.cpp decides)
}


def sample(key: str, default: Any, tmp_path: Path) -> Any:
    if key in ("lora_path", "clip_model_path"):
        adapter = tmp_path / f"{key}.gguf"
        adapter.write_bytes(b"")
        return str(adapter)
    if key in SAMPLES:
        return SAMPLES[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    raise AssertionError(f"no sample value for the stock key {key!r}: add one to SAMPLES")


@pytest.fixture(scope="module")
def tiny() -> Iterator[Model]:
    model = Model(cached_tiny_llama(), verbose=False)
    yield model
    model.close()


def resolved(settings: ModelSettings, model: Model) -> ModelPlan:
    """The plan the settings serve `model` with (mapped before the load, then resolved against it)."""
    return resolve(settings, plan(settings), "m", model)


def test_every_stock_key_is_applied_or_refused(tmp_path, tiny):
    """Set each stock key alone to another value: the plan changes, or the key is refused by name,
    or it is listed as what the engine always does (with the reason)."""
    base = resolved(ModelSettings(model="m.gguf"), tiny)
    ours = ModelSettings.model_fields
    for key in StockModelSettings.model_fields:
        value = sample(key, ours[key].default, tmp_path)
        given = {"cache": True} if key == "cache_size" else {}  # stock: "only used if cache is True"
        if key == "draft_model_num_pred_tokens":  # stock: only with a draft_model
            given = {"draft_model": "prompt-lookup-decoding"}
        settings = ModelSettings(**{"model": "m.gguf", **given, key: value})
        if key in REFUSED:
            with pytest.raises(SettingsRefused, match=f"^{key}: "):
                plan(settings)
        elif key in ALWAYS_SO:
            assert resolved(settings, tiny) == base
        else:
            assert resolved(settings, tiny) != resolved(ModelSettings(model="m.gguf", **given), tiny), \
                f"{key}={value!r} reaches nothing"


def test_max_ctx_is_resolved_against_the_loaded_model(tiny):
    """max_ctx is an int in the plan whatever was asked: --max_ctx, else --n_ctx, else (0, stock's
    "from the model") the model's training context; more than that is refused before anything is sized."""
    assert tiny.n_ctx_train == 4096
    for asked, expected in (({"n_ctx": 0}, 4096), ({"n_ctx": 512}, 512), ({"n_ctx": 512, "max_ctx": 300}, 300)):
        served = resolved(ModelSettings(model="m.gguf", **asked), tiny)
        assert served.max_ctx == served.engine.max_ctx == expected and type(served.max_ctx) is int
        assert served.pflash.max_tokens == expected + 256  # the drafter's room: max_ctx and an explicit query
    with pytest.raises(ValueError, match="max_ctx 5000 exceeds the model's training context 4096"):
        resolved(ModelSettings(model="m.gguf", max_ctx=5000), tiny)


def test_every_pflash_key_is_mapped(tmp_path, tiny):
    """Each of our PFlash keys set alone to another value changes the resolved plan (nothing
    downstream reads the settings)."""
    base = resolved(ModelSettings(model="m.gguf", pflash="always"), tiny)
    others: dict[str, Any] = {"pflash": "auto", "pflash_drafter": "d.gguf", "pflash_layers": [1],
                              "pflash_curve": "100:0.5", "pflash_rope": "pre", "pflash_selector": "nope",
                              "pflash_scorer": "numpy", "pflash_cache_dir": str(tmp_path),
                              "pflash_drafter_pin_view": "on", "pflash_calibrate": "on", "draft_residency": "auto",
                              "pflash_drafter_window": 0, "pflash_keep_ratio": 0.5}
    keys = [key for key in ModelSettings.model_fields if key.startswith("pflash") or key == "draft_residency"]
    assert len(keys) > 25
    for key in keys:
        default = ModelSettings.model_fields[key].default
        value = others.get(key, default + 1 if isinstance(default, int) and not isinstance(default, bool)
                           else not default if isinstance(default, bool)
                           else default / 2 if isinstance(default, float) else 2)
        settings = ModelSettings(**{"model": "m.gguf", "pflash": "always", key: value})
        if key == "pflash_selector":  # only greedy is installed here: another name is looked up, and refused
            with pytest.raises(ValueError, match="no PFlash selector named 'nope'"):
                resolved(settings, tiny)
            continue
        assert resolved(settings, tiny) != base, f"{key}={value!r} reaches nothing"


def test_refused_keys_at_their_stock_defaults_start(tmp_path):
    stock = StockModelSettings.model_fields
    plan(ModelSettings(model="m.gguf", **{key: stock[key].default for key in REFUSED}))


@pytest.mark.parametrize("key, value", [
    ("lora_path", "/nonexistent/adapter.gguf"),
    ("clip_model_path", "/models/mmproj.gguf"),  # no such file
    ("rpc_servers", "127.0.0.1:1"),  # no RPC backend in the wheel, or nobody listening there
    ("kv_overrides", ["llama.context_length=1234"]),
    ("split_mode", 7),  # llama.cpp has none (0) to tensor (3)
])
def test_served_model_refuses_at_start_naming_the_key(tiny_model, key, value):
    with pytest.raises(SettingsRefused, match=f"^{key}: "):
        ServedModel(ModelSettings(model=str(tiny_model), verbose=False, n_threads=1, **{key: value}))


def test_cli_says_which_key_it_refuses(tiny_model):
    run = subprocess.run([sys.executable, "-m", "pflash_plugin.server", "--model", str(tiny_model), "--port", "0",
                          "--clip_model_path", "mmproj.gguf"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "clip_model_path: no such file: mmproj.gguf" in run.stderr


def target(settings: dict[str, Any]) -> Model:
    return Model(cached_tiny_llama(), plan(ModelSettings(model="m.gguf", **settings)).target)


def last_logits(model: Model) -> np.ndarray:
    """Logits after a 16-token prompt (positions matter: rope has something to rotate)."""
    ctx = Context(model, ContextConfig(n_ctx=64, n_batch=32, n_ubatch=32, n_threads=1, n_threads_batch=1))
    tokens = model.tokenize("the water of the world is hello there people and more things to say")
    batch = Batch(32, 1)
    for pos, token in enumerate(tokens):
        batch.add(token, pos, 0, pos == len(tokens) - 1)
    ctx.decode(batch)
    return ctx.logits(len(tokens) - 1)


def test_kv_overrides_reach_the_model():
    assert target({}).n_ctx_train == 4096
    assert target({"kv_overrides": ["llama.context_length=int:1234"]}).n_ctx_train == 1234


def test_rope_freq_base_moves_the_logits():
    base = last_logits(target({}))
    assert np.abs(last_logits(target({"rope_freq_base": 100.0})) - base).max() > 1e-4
    assert np.abs(last_logits(target({"rope_freq_base": 10000.0})) - base).max() == 0  # the model's own


def test_lora_adapter_applies_to_every_context(tmp_path):
    lora = str(write_tiny_lora(tmp_path / "lora.gguf"))
    model = target({"lora_path": lora})
    assert np.abs(last_logits(model) - last_logits(target({}))).max() > 0.1
    assert np.array_equal(last_logits(model), last_logits(model))  # a second context of it: the same


def generate(settings: dict[str, Any], params: SamplingParams) -> list[int]:
    """One request through an engine built from the settings' plan."""
    given = ModelSettings(model="m.gguf", n_ctx=256, max_concurrency=1, n_threads=1, n_threads_batch=1, **settings)
    model = Model(cached_tiny_llama(), plan(given).target)
    engine = build_engine(model, resolved(given, model).engine)
    done = threading.Event()
    request = Request(model.tokenize("the water of the world"), params)
    request.sink = lambda event: done.set() if isinstance(event, (FinishEvent, ErrorEvent)) else None
    try:
        engine.submit(request)
        assert done.wait(120), "request did not finish"
        return request.output_tokens
    finally:
        engine.stop()
        engine.close()
        model.close()


def test_seed_makes_unseeded_requests_repeat():
    unseeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert generate({"seed": 7}, unseeded) == generate({"seed": 7}, unseeded)


def test_last_n_tokens_size_is_the_penalty_window():
    greedy = SamplingParams(max_tokens=24, temperature=0)
    penalised = SamplingParams(max_tokens=24, temperature=0, repeat_penalty=5.0)
    plain = generate({}, greedy)
    assert generate({}, penalised) != plain  # the default window (64) sees the repeats
    assert generate({"last_n_tokens_size": 0}, penalised) == plain  # an empty window penalises nothing


KWARG_TEMPLATE = "{{ bos_token }}{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_chat_template_kwargs_reach_the_template():
    model = str(cached_tiny_llama(chat_template=KWARG_TEMPLATE))
    for kwargs, expected in (({"shout": True}, True), (None, False)):
        served = ServedModel(ModelSettings(model=model, n_ctx=256, verbose=False, n_threads=1,
                                           chat_template_kwargs=kwargs))
        try:
            text = served.model.detokenize(served.prompts.render_chat([{"role": "user", "content": "hello"}]).tokens)
            assert ("LOUD" in text) is expected
        finally:
            served.close()


def test_a_sequence_is_written_into_the_batch_as_one_token_at_a_time_would_be():
    one, whole = Batch(8, 2), Batch(8, 2)
    try:
        for batch in (one, whole):
            batch.add(5, 0, 1, True)
        for offset, token in enumerate([7, 8, 9]):
            one.add(token, 40 + offset, 3, offset == 2)
        assert whole.add_sequence([7, 8, 9], 40, 3, True) == 3 == one.n_tokens - 1
        whole.add_sequence([4], 0, 0, False)
        one.add(4, 0, 0, False)
        raw_one, raw_whole = one.raw, whole.raw
        assert raw_whole.n_tokens == raw_one.n_tokens == 5
        for field in ("token", "pos", "n_seq_id", "logits"):
            assert [getattr(raw_whole, field)[i] for i in range(5)] == [getattr(raw_one, field)[i] for i in range(5)]
        assert [raw_whole.seq_id[i][0] for i in range(5)] == [1, 3, 3, 3, 0]
        assert [raw_whole.logits[i] for i in range(5)] == [1, 0, 0, 1, 0]
        with pytest.raises(OverflowError):
            whole.add_sequence([1, 2, 3, 4], 0, 0, False)
    finally:
        one.close()
        whole.close()


@pytest.mark.parametrize("given, gpu_layers, gpus, expected", [
    ({}, -1, 1, 2048),  # a GPU model without n_batch: llama-server's
    ({"n_batch": 512}, -1, 1, 512),  # given: kept
    ({"n_batch": 4096}, -1, 1, 4096),
    ({}, 0, 1, 512),  # layers on the CPU: stock's
    ({}, -1, 0, 512),  # no GPU
])
def test_n_batch_defaults_to_llama_servers_on_a_gpu(monkeypatch, given, gpu_layers, gpus, expected):
    from pflash_plugin.server.config import llama_params

    monkeypatch.setattr(llama_params, "gpu_count", lambda: gpus)  # no GPU here: what a count of them picks
    settings = ModelSettings(model="m.gguf", n_gpu_layers=gpu_layers, **given)
    engine = llama_params.engine_config(settings, llama_params.ModelParams(n_gpu_layers=gpu_layers), 4096)
    assert engine.n_batch == expected


@pytest.mark.parametrize("given, env_before, expected", [
    ({"max_concurrency": 128}, None, "1"),  # flash attention llama.cpp's auto (on with a GPU)
    ({"max_concurrency": 128, "flash_attn": True}, None, "1"),
    ({"max_concurrency": 32}, None, "1"),  # where the online load aborted ours and llama-server with them
    ({"max_concurrency": 31}, None, None),  # fewer slots: no run failed with CUDA graphs
    ({"max_concurrency": 128, "flash_attn": False}, None, None),  # the failures need flash attention
    ({"max_concurrency": 128, "cuda_graphs": "on"}, None, None),  # the operator's choice
    ({"max_concurrency": 4, "cuda_graphs": "off"}, None, "1"),
    ({"max_concurrency": 128, "n_gpu_layers": 0}, None, None),  # no layers on the GPU: no graphs to turn off
    ({"max_concurrency": 128}, "0", "0"),  # the environment decided already: kept
])
def test_cuda_graphs_go_off_where_they_hung(monkeypatch, given, env_before, expected):
    """CUDA graphs aborted or hung servers with flash attention from 32 slots (llama/cuda_graphs.py):
    auto turns them off for the process there, through ggml's own switch, before any weights load."""
    from pflash_plugin.llama.cuda_graphs import DISABLE_ENV
    from pflash_plugin.server.config import llama_params

    monkeypatch.setenv(DISABLE_ENV, env_before or "")  # recorded, so what bring_up sets is undone after
    if env_before is None:
        monkeypatch.delenv(DISABLE_ENV)
    monkeypatch.setattr(llama_params, "gpu_count", lambda: 1)  # no GPU here: what one would see
    llama_params.bring_up(plan(ModelSettings(model="m.gguf", n_gpu_layers=given.pop("n_gpu_layers", -1), **given)))
    assert os.environ.get(DISABLE_ENV) == expected


def test_cuda_graphs_are_left_alone_without_a_gpu(monkeypatch):
    from pflash_plugin.llama.cuda_graphs import DISABLE_ENV
    from pflash_plugin.server.config import llama_params

    monkeypatch.setenv(DISABLE_ENV, "")  # recorded, so what bring_up might set is undone after
    monkeypatch.delenv(DISABLE_ENV)
    llama_params.bring_up(plan(ModelSettings(model="m.gguf", max_concurrency=128, cuda_graphs="off")))
    assert DISABLE_ENV not in os.environ
