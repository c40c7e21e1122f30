"""Stock's speculative flags over HTTP (issue 47): `--draft_model prompt-lookup-decoding` with
`--draft_model_num_pred_tokens` is served (it was refused at start), the greedy text is the one a
server without it gives, `"speculative": false` turns it off for one request, and /metrics and
/status count the drafts."""
from __future__ import annotations

import re

import pytest

from conftest import live_server
from pflash_plugin.server.config.llama_params import SettingsRefused, speculation_config
from pflash_plugin.server.config.settings import ModelSettings

COPY = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. Every cloud has a silver "
        "lining. ") * 3 + "The same text, word for word:"


def _model(tiny_model, **extra) -> dict:
    return {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 1024, "max_concurrency": 2,
            "n_threads": 1, "n_threads_batch": 1, **extra}


def _metric(text: str, name: str) -> float:
    match = re.search(rf'^{name}\{{model_name="tiny"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_stock_prompt_lookup_flags_serve_the_same_greedy_text(tiny_model):
    body = {"prompt": COPY, "temperature": 0, "max_tokens": 160}  # room for probes after an unlucky one
    chat = {"messages": [{"role": "user", "content": COPY}], "temperature": 0, "max_tokens": 32}
    with live_server([_model(tiny_model)]) as plain, \
            live_server([_model(tiny_model, draft_model="prompt-lookup-decoding",
                                draft_model_num_pred_tokens=6)]) as fast:
        with plain.client() as a, fast.client() as b:
            # turned off for one request, first, while the policy is at its (drafting) prior: no draft
            off = b.post("/v1/chat/completions", json={**chat, "speculative": False}).json()
            assert fast.status()["speculation"]["drafted"] == 0
            assert off["choices"][0]["message"]["content"] == \
                a.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
            expected = a.post("/v1/completions", json=body).json()
            got = b.post("/v1/completions", json=body).json()
            assert got["choices"][0]["text"] == expected["choices"][0]["text"]
            assert got["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
            spec = fast.status()["speculation"]
            assert spec["accepted"] > 0 and spec["tokens_per_row_step"] > 1.0, spec
            assert "speculation" not in plain.status()
            metrics = b.get("/metrics").text
            assert _metric(metrics, "pflash_spec_decode_num_accepted_tokens_total") == spec["accepted"]
            assert _metric(metrics, "pflash_spec_decode_num_draft_tokens_total") == spec["drafted"]
            assert _metric(metrics, "pflash_spec_decode_tokens_per_step") > 1.0
            assert _metric(metrics, "pflash_spec_decode_probes_total") == spec["probes"] >= 1  # budget.py's
            assert spec["draft_steps"] >= 1 and spec["draft_step_seconds"] > 0 and spec["plain_steps"] >= 1
            assert "pflash_spec_decode" not in a.get("/metrics").text
            bad = b.post("/v1/completions", json={**body, "speculative": "sometimes"})
            assert bad.status_code == 400 and "speculative" in bad.text


def test_bad_speculative_settings_are_refused_by_name(tmp_path):
    with pytest.raises(SettingsRefused, match="^draft_model: .*no such file"):
        speculation_config(ModelSettings(model="m.gguf", draft_model=str(tmp_path / "none.gguf")))
    with pytest.raises(SettingsRefused, match="^draft_model_num_pred_tokens: at least 1"):
        speculation_config(ModelSettings(model="m.gguf", draft_model="prompt-lookup-decoding",
                                         draft_model_num_pred_tokens=0))
    assert speculation_config(ModelSettings(model="m.gguf")) is None
