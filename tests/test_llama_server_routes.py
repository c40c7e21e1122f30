"""llama-server's own routes (tools/server/server.cpp's route table): POST /completion (and
/completions), /tokenize, /detokenize, /apply-template and GET /props, in llama-server's request and
answer shapes (its tests/unit/test_completion.py, test_tokenize.py, test_template.py), its errors
{"error": {"code": 400, ...}}, under the API key and counted in /metrics as the other routes."""
from __future__ import annotations

import json
import time

import pytest

from pflash_plugin.llama import Model
from pflash_plugin.llama.tiny_gguf import write_tiny_lora
from pflash_plugin.testing import cached_tiny_llama

from conftest import live_server

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"
FORCED = 'root ::= "world"'  # the answer's shape on a random model
KEY = "sk-llama"


@pytest.fixture(scope="module")
def vocab() -> Model:
    return Model(cached_tiny_llama(chat_template=TEMPLATE), vocab_only=True)


@pytest.fixture(scope="module")
def server():
    model = {"model": str(cached_tiny_llama(chat_template=TEMPLATE)), "model_alias": "tiny", "n_ctx": 512,
             "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model], api_key=KEY) as running:
        yield running


def _post(server, path: str, body: dict, key: str | None = KEY):
    with server.client() as client:
        return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})


def _events(reply) -> list[dict]:
    lines = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines and "[DONE]" not in lines  # llama-server ends its stream with the last object, no [DONE]
    return [json.loads(line) for line in lines]


def test_completion_answers_in_llama_servers_shape(server, vocab):
    body = {"prompt": "Hello", "n_predict": 8, "grammar": FORCED, "return_tokens": True, "cache_prompt": False}
    whole = _post(server, "/completion", body).json()
    assert whole["content"] == "world" and whole["stop"] is True and whole["stop_type"] == "eos"
    assert vocab.detokenize(whole["tokens"]) == "world" and whole["tokens_predicted"] == len(whole["tokens"])
    assert whole["tokens_evaluated"] == len(vocab.tokenize("Hello", add_special=True)) and whole["truncated"] is False
    assert whole["timings"]["predicted_n"] == len(whole["tokens"]) and whole["has_new_line"] is False
    assert whole["generation_settings"]["n_predict"] == 8 and "prompt" in whole
    assert _post(server, "/completion", {**body, "return_tokens": False}).json()["tokens"] == []
    alias = _post(server, "/completions", body).json()  # llama-server's alias; /v1/completions stays OpenAI's
    assert alias["content"] == "world" and "choices" in _post(server, "/v1/completions", body).json()


def test_completion_streams_without_done(server, vocab):
    events = _events(_post(server, "/completion", {"prompt": "Hello", "n_predict": 8, "grammar": FORCED,
                                                   "stream": True, "return_tokens": True}))
    assert "".join(e["content"] for e in events) == "world"
    assert vocab.detokenize([t for e in events for t in e["tokens"]]) == "world"
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "eos" and "timings" in events[-1]
    assert not any(e["stop"] for e in events[:-1])


def test_completion_reads_llama_servers_prompts(server, vocab):
    ids = vocab.tokenize("Hello", add_special=True)
    two = _post(server, "/completion", {"prompt": [ids, "Hello"], "n_predict": 4, "grammar": FORCED}).json()
    assert [a["content"] for a in two] == ["world", "world"] and [a["index"] for a in two] == [0, 1]
    assert two[0]["tokens_evaluated"] == two[1]["tokens_evaluated"] == len(ids)  # the text gets its BOS too
    mixed = _post(server, "/completion", {"prompt": [*ids, " there"], "n_predict": 4, "grammar": FORCED}).json()
    assert mixed["tokens_evaluated"] == len(ids) + len(vocab.tokenize(" there", add_special=False))
    obj = _post(server, "/completion", {"prompt": [{"prompt_string": "Hello"}, ids], "n_predict": 4}).json()
    assert len(obj) == 2 and obj[0]["tokens_evaluated"] == len(ids)
    alone = _post(server, "/completion", {"prompt": {"prompt_string": "Hello"}, "n_predict": 4}).json()
    assert alone["tokens_evaluated"] == len(ids)
    picked = _post(server, "/completion", {"prompt": "Hello", "n_predict": 4, "grammar": FORCED,
                                           "response_fields": ["content", "generation_settings/n_predict"]}).json()
    assert picked == {"content": "world", "generation_settings/n_predict": 4}
    every = _post(server, "/completion", {"prompt": "Hello", "n_predict": 1, "response_fields": []}).json()
    assert "generation_settings" in every and "timings" in every  # none listed: all of them (llama-server's rule)
    nothing = _post(server, "/completion", {"prompt": "Hello", "n_predict": 0}).json()
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0 and nothing["stop_type"] == "limit"


def test_completion_takes_llama_servers_logit_bias(server, vocab):
    """[[text or id, bias]] or {text or id: bias}: a text's tokens each get the bias."""
    body = {"prompt": "Hello", "n_predict": 8, "temperature": 0, "grammar": 'root ::= "world" | "there"'}
    ids = vocab.tokenize("there", add_special=False)
    starts = [t for t in range(vocab.n_vocab) if vocab.piece(t) and b"world".startswith(vocab.piece(t))]
    for bias in ([["there", 100]], {"there": 100}, [[t, 100] for t in ids], {str(t): 100 for t in ids},
                 [[t, False] for t in starts]):  # false: never (each way to start "world")
        assert _post(server, "/completion", {**body, "logit_bias": bias}).json()["content"] == "there"
    for bias in ([["world", 100]], {"world": 100}, {"there": True}):  # true: skipped
        assert _post(server, "/completion", {**body, "logit_bias": bias}).json()["content"] == "world"


def test_completion_probabilities_as_llama_server_sends_them(server, vocab):
    """n_probs: each token's id, text, bytes and log-probability, and the n best; streamed, one
    event a token, each with its one entry (llama.cpp's test_n_probs, test_n_probs_stream)."""
    body = {"prompt": "Hello", "n_predict": 4, "n_probs": 3, "temperature": 0}
    whole = _post(server, "/completion", {**body, "return_tokens": True}).json()
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"] and len(probs) == whole["tokens_predicted"] > 0
    for p in probs:
        assert p["token"] == vocab.piece(p["id"]).decode(errors="replace") and p["bytes"] == list(vocab.piece(p["id"]))
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]  # greedy
        assert all(set(top) == {"id", "token", "bytes", "logprob"} for top in p["top_logprobs"])
    events = _events(_post(server, "/completion", {**body, "stream": True}))
    pieces = [e for e in events if not e["stop"]]
    assert [len(e["completion_probabilities"]) for e in pieces] == [1] * len(probs)
    assert [e["completion_probabilities"][0]["id"] for e in pieces] == whole["tokens"]
    assert [e["completion_probabilities"][0]["logprob"] for e in pieces] == pytest.approx([p["logprob"] for p in probs],
                                                                                          abs=1e-3)
    assert "".join(e["content"] for e in events) == whole["content"] and "completion_probabilities" not in events[-1]
    assert "completion_probabilities" not in _post(server, "/completion", {**body, "n_probs": 0}).json()


@pytest.mark.parametrize("body, field", [
    ({"prompt": "a", "n_probs": 21}, "n_probs"),
    ({"prompt": "a", "n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": [1, 10**9]}, "prompt.1"),
    ({"prompt": [{"prompt_string": "a", "multimodal_data": ["AAAA"]}]}, "prompt.0.multimodal_data"),
    ({"prompt": [1, [2, 3]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "logit_bias": [[10**9, 5]]}, "logit_bias"),
])
def test_completion_errors_name_the_field_in_llama_servers_shape(server, body, field):
    reply = _post(server, "/completion", body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith(field) and error["param"] == field


def test_tokenize_and_detokenize(server, vocab):
    text = "Hello world"
    plain = _post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert plain == vocab.tokenize(text, add_special=False, parse_special=True)
    assert _post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == [vocab.bos, *plain]
    pieces = _post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain and "".join(p["piece"] for p in pieces) == text
    assert _post(server, "/detokenize", {"tokens": plain}).json() == {"content": text}
    bad = _post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    assert _post(server, "/tokenize", {}).json()["error"]["param"] == "content"


def test_apply_template_renders_the_chat(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = _post(server, "/apply-template", {"messages": messages})
    assert reply.json() == {"prompt": "<system>Be brief.</system><user>Hi</user><assistant>"}
    bad = _post(server, "/apply-template", {"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


def test_props_holds_what_a_client_reads(server):
    props = _post_get(server, "/props")
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 2
    assert props["chat_template"] == TEMPLATE and props["model_path"].endswith(".gguf")
    assert props["modalities"] == {"vision": False, "audio": False} and "pflash-plugin" in props["build_info"]


def _post_get(server, path: str) -> dict:
    with server.client() as client:
        return client.get(path, headers={"Authorization": f"Bearer {KEY}"}).json()


def test_the_api_key_and_metrics_apply(server):
    for path in ("/completion", "/tokenize", "/detokenize", "/apply-template"):
        assert _post(server, path, {"prompt": "a"}, key=None).status_code == 401
    metrics = _post_get_text(server, "/metrics")
    _post(server, "/completion", {"prompt": [1, 10**9]})
    _post(server, "/completion", {"prompt": "a", "n_predict": 8, "grammar": FORCED})
    after = _post_get_text(server, "/metrics")
    assert _count(after, 'pflash_errors_total{model_name="tiny",status="400"}') == \
        _count(metrics, 'pflash_errors_total{model_name="tiny",status="400"}') + 1
    assert _count(after, 'pflash_requests_total{finish_reason="stop",model_name="tiny"}') == \
        _count(metrics, 'pflash_requests_total{finish_reason="stop",model_name="tiny"}') + 1


def test_metrics_carry_llama_servers_series(server):
    """llama-server's unlabelled llamacpp:* lines, each with its HELP and TYPE (a counter's TYPE names
    its _total sample, as llama-server writes it), counting what /completion's timings report
    (llama.cpp's test_metrics.py); the Process-Start-Time-Unix header; timings' rate over the
    tokens after the first."""
    before = _llama_series(_post_get_text(server, "/metrics"))
    one = _post(server, "/completion", {"prompt": "Hello", "n_predict": 1}).json()["timings"]
    six = _post(server, "/completion", {"prompt": "Hello there", "n_predict": 6, "grammar": 'root ::= "a"{6}'}).json()
    with server.client() as client:
        reply = client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    after = _llama_series(reply.text)
    started = reply.headers["Process-Start-Time-Unix"]  # any case: uvicorn's httptools path lowercases names
    assert abs(int(started) - time.time()) < 3600
    grown = {name: after[name][1] - before[name][1] for name in after}
    assert grown["llamacpp:tokens_predicted_total"] == one["predicted_n"] + six["timings"]["predicted_n"] == 7
    assert grown["llamacpp:prompt_tokens_total"] == one["prompt_n"] + six["timings"]["prompt_n"]
    assert grown["llamacpp:prompt_tokens_cached_total"] == one["cache_n"] + six["timings"]["cache_n"]
    assert after["llamacpp:n_decode_total"] == ("counter", after["llamacpp:n_decode_total"][1]) and grown[
        "llamacpp:n_decode_total"] > 0
    assert after["llamacpp:requests_processing"] == ("gauge", 0.0) and after["llamacpp:n_tokens_max"][1] >= 7
    assert one["predicted_per_second"] == 0.0  # one token: no decode step of its own
    timed = six["timings"]
    assert timed["predicted_per_second"] == pytest.approx(1e3 / timed["predicted_ms"] * 5)


def _llama_series(text: str) -> dict[str, tuple[str, float]]:
    """{name: (TYPE, value)} of the llamacpp:* samples; each has its HELP line and a TYPE of its own name."""
    types = dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE llamacpp:"))
    series = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.split(" ")
            assert f"# HELP {name} " in text
            series[name] = (types[name], float(value))
    return series


def test_metrics_count_embeddings_as_llama_server():
    """An embeddings request's prompt counts among the prompt tokens, its decodes among the decode calls,
    nothing predicted (llama.cpp's test_metrics_embedding_prompt_is_counted)."""
    model = {"model": str(cached_tiny_llama()), "embedding": True, "n_ctx": 256, "n_threads": 1,
             "n_threads_batch": 1}
    with live_server([model]) as running, running.client() as client:
        reply = client.post("/v1/embeddings", json={"input": ["hello world", "goodbye world"]}).json()
        after = _llama_series(client.get("/metrics").text)
    assert after["llamacpp:prompt_tokens_total"][1] == reply["usage"]["prompt_tokens"] > 0
    assert after["llamacpp:n_decode_total"][1] == 2 and after["llamacpp:tokens_predicted_total"][1] == 0


def test_metrics_can_be_turned_off():
    model = {"model": str(cached_tiny_llama()), "n_ctx": 256, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model], metrics=False) as running, running.client() as client:
        assert client.get("/metrics").status_code == 501


def test_lora_adapters_are_the_servers(tmp_path):
    """GET /lora-adapters lists the adapter; its scales are the server's: POST and a request's
    `lora` (llama-server's [{id, scale}], the unlisted 0) pass where they leave them as they are,
    and are a 400 saying so where they would change them (one batch carries every request here)."""
    lora = str(write_tiny_lora(tmp_path / "lora.gguf"))
    model = {"model": str(cached_tiny_llama(chat_template=TEMPLATE)), "lora_path": lora, "n_ctx": 256,
             "n_threads": 1, "n_threads_batch": 1}
    with live_server([model]) as running, running.client() as client:
        listed = client.get("/lora-adapters").json()
        assert listed == [{"id": 0, "path": lora, "scale": 1.0, "task_name": "", "prompt_prefix": ""}]
        assert client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).json() == {"success": True}
        assert "array" in client.post("/lora-adapters", json={"id": 0}).json()["error"]["message"]
        assert client.post("/lora-adapters", json=[{"id": "x"}]).json()["error"]["param"] == "0.id"
        for scales in ([{"id": 0, "scale": 0.5}], []):  # [] sets every adapter to 0
            changed = client.post("/lora-adapters", json=scales)
            assert changed.status_code == 400 and changed.json()["error"]["code"] == 400
            assert "--lora_path" in changed.json()["error"]["message"]
        same = {"prompt": "Hello", "n_predict": 2, "lora": [{"id": 0, "scale": 1}]}
        assert client.post("/completion", json=same).status_code == 200
        assert client.post("/completion", json={**same, "lora": []}).status_code == 200  # []: the server's
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for path, body in (("/completion", same), ("/v1/completions", same), ("/v1/chat/completions", chat)):
            other = client.post(path, json={**body, "lora": [{"id": 0, "scale": 0.0}]})
            assert other.status_code == 400 and other.json()["error"]["param"] == "lora"
        unknown = client.post("/completion", json={**same, "lora": [{"id": 3, "scale": 1.0}]})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora.0.id"


def _post_get_text(server, path: str) -> str:
    with server.client() as client:
        return client.get(path, headers={"Authorization": f"Bearer {KEY}"}).text


def _count(metrics: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name)), 0.0)


def test_slots_show_each_slots_state(vocab):
    """GET /slots as llama-server answers it (test_basic's test_server_slots, test_completion's
    test_cancel_request): each slot, busy while a request runs in it, idle once the client is gone;
    ?fail_on_no_slot=1 a 503 when none is idle."""
    model = {"model": str(cached_tiny_llama(chat_template=TEMPLATE)), "n_ctx": 4096, "max_concurrency": 2,
             "n_threads": 1, "n_threads_batch": 1}
    endless = {"prompt": "Hello", "n_predict": 4000, "stream": True,  # seconds of tokens, cut short below
               "logit_bias": [[t, False] for t in range(vocab.n_vocab) if vocab.is_eog(t)]}
    with live_server([model]) as running, running.client() as client:
        idle = client.get("/slots").json()
        assert [s["id"] for s in idle] == [0, 1] and all(s["n_ctx"] == 4096 and not s["is_processing"] for s in idle)
        with client.stream("POST", "/completion", json=endless) as one, \
                client.stream("POST", "/completion", json=endless) as two:
            lines = one.iter_lines(), two.iter_lines()  # kept: a dropped iterator closes its stream
            assert all(next(each).startswith("data: ") for each in lines)  # both decoding
            busy = client.get("/slots").json()
            full = client.get("/slots?fail_on_no_slot=1")
        assert all(s["is_processing"] and s["state"] in ("prefill", "decode") and "id_task" in s for s in busy), busy
        assert full.status_code == 503 and full.json()["error"]["code"] == 503
        deadline = time.monotonic() + 10
        while any(s["is_processing"] for s in client.get("/slots").json()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(s["is_processing"] for s in client.get("/slots").json())  # the clients left: cancelled
        assert client.get("/slots?fail_on_no_slot=1").status_code == 200
        saved = client.post("/slots/0?action=save", json={"filename": "a.bin"})
        assert saved.status_code == 501 and saved.json()["error"]["type"] == "not_supported_error"


def test_slots_can_be_turned_off():
    model = {"model": str(cached_tiny_llama()), "n_ctx": 256, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model], slots=False) as running, running.client() as client:
        reply = client.get("/slots")
    assert reply.status_code == 501 and reply.json()["error"]["type"] == "not_supported_error"
