"""End to end on a real server on loopback with a tiny generated model."""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time

import httpx
import pytest

from conftest import live_server


def stream_completion(client: httpx.Client, **body) -> tuple[str, dict | None, str | None]:
    text, usage, finish = "", None, None
    with client.stream("POST", "/v1/completions", json={"stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, usage, finish


def test_eight_concurrent_streams_complete_with_usage(tiny_server):
    prompts = [f"request number {i} says hello to the world" for i in range(8)]
    with tiny_server.client() as client, cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(
            lambda p: stream_completion(client, prompt=p, max_tokens=20, temperature=0,
                                        stream_options={"include_usage": True}),
            prompts,
        ))
        n_prompt = [len(client.post("/extras/tokenize", json={"input": p}).json()["tokens"]) for p in prompts]
    for (text, usage, finish), expected_prompt in zip(results, n_prompt):
        assert finish == "length" and text
        assert usage["completion_tokens"] == 20
        assert usage["prompt_tokens"] == expected_prompt
        assert usage["total_tokens"] == expected_prompt + 20
        assert usage["timings"]["ttft_ms"] > 0


def test_same_seed_same_output(tiny_server):
    body = dict(prompt="the weather today is", max_tokens=16, temperature=0.9)
    with tiny_server.client() as client:
        replies = [client.post("/v1/completions", json={**body, "seed": seed}).json() for seed in (1, 1, 2)]
        texts = [reply["choices"][0]["text"] for reply in replies]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]  # the seed is really used


def test_prefix_reuse_reports_cached_tokens(tiny_server):
    prompt = "a shared system prompt that is long enough to be worth caching " * 4
    with tiny_server.client() as client:
        client.post("/v1/completions", json={"prompt": prompt + "first", "max_tokens": 4, "temperature": 0})
        second = {"prompt": prompt + "second", "max_tokens": 4, "temperature": 0}
        usage = client.post("/v1/completions", json=second).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(prompt) // 4
    assert usage["timings"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]


def test_bad_inputs_get_openai_errors(tiny_server):
    with tiny_server.client() as client:
        too_long = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 600})
        assert too_long.status_code == 400
        message = too_long.json()["error"]["message"]
        assert "600" in message and "512" in message
        invalid = client.post("/v1/completions", json={"prompt": "hi", "top_p": 3})
        assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "top_p"
        missing = client.post("/v1/chat/completions", json={"max_tokens": 3})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
        grammar = client.post("/v1/completions", json={"prompt": "hi", "grammar": "nonsense"})
        assert grammar.status_code == 400 and "grammar" in grammar.json()["error"]["message"]
        bias = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"99999999": 5}})
        assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias"
        unknown = client.post("/v1/completions", json={"prompt": "hi", "model": "nope", "max_tokens": 2})
        # one model: any name reaches it (404: two models)
        assert unknown.status_code == 200 and unknown.json()["model"] == "tiny"
        detok = client.post("/extras/detokenize", json={"tokens": [-5]})
        assert detok.status_code == 400
        # and the server still serves
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_stop_strings_and_logprobs(tiny_server):
    with tiny_server.client() as client:
        body = {"prompt": "one two", "max_tokens": 24, "temperature": 0}
        full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = full[5:8]
        cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
        lp = client.post("/v1/completions", json={**body, "max_tokens": 5, "logprobs": 3}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    logprobs = lp["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 5 and all(x <= 0 for x in logprobs["token_logprobs"])
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 3 and abs(max(top.values()) - chosen) < 1e-6


def test_chat_json_response_format_is_valid_json(tiny_server):
    with tiny_server.client() as client:
        body = {"messages": [{"role": "user", "content": "give json"}], "max_tokens": 40, "temperature": 0,
                "response_format": {"type": "json_object", "schema": {
                    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
        reply = client.post("/v1/chat/completions", json=body).json()
    content = reply["choices"][0]["message"]["content"]
    if reply["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content)["a"], int)
    else:  # cut by max_tokens: still a JSON prefix following the schema
        assert content.startswith('{') and '"a"' in content


def test_full_queue_gets_429_with_retry_after(tiny_model):
    model = {"model": str(tiny_model), "n_ctx": 256, "max_concurrency": 1, "max_queue": 1, "n_threads": 1,
             "n_threads_batch": 1}
    with live_server([model]) as server:
        with server.client() as client, cf.ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(
                lambda i: client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 200}), range(6)))
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 429 in codes
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.headers["retry-after"] and rejected.json()["error"]["type"] == "rate_limit_exceeded"


def test_full_pool_queues_instead_of_failing(tiny_model):
    # a pool of 256 tokens, requests reserving 150: only one fits at a time, the rest wait
    model = {"model": str(tiny_model), "n_ctx": 200, "kv_pool_tokens": 256, "max_concurrency": 4, "n_threads": 1,
             "n_threads_batch": 1}
    with live_server([model]) as server:
        with server.client() as client, cf.ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(
                lambda i: client.post("/v1/completions", json={"prompt": f"q{i} " * 5, "max_tokens": 140}), range(4)))
        assert [r.status_code for r in responses] == [200] * 4
        assert all(r.json()["usage"]["completion_tokens"] == 140 for r in responses)
        assert max(r.json()["usage"]["timings"]["queue_ms"] for r in responses) > 0


def test_disconnect_frees_pages(tiny_server):
    idle = tiny_server.wait_idle()["kv_pages_used"]
    with tiny_server.client() as client:
        body = {"prompt": "disconnect me", "max_tokens": 400, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # got the first token; close the connection mid-stream
        status = tiny_server.wait_idle()
    assert status["running"] == 0
    # the cancelled request's reservation (prompt + 400 tokens) is gone; only its cached tokens stay
    assert status["kv_pages_used"] <= idle + -(-(status["prefix_cache_tokens"]) // status["kv_page_size"]) + 1


def test_soak_mixed_requests_return_pool_to_idle(tiny_server):
    rng = random.Random(7)
    bases = ["alpha beta gamma ", "the quick brown fox ", "lorem ipsum dolor "]

    def one(i: int) -> int:
        prompt = rng.choice(bases) * rng.randint(1, 6) + str(i)
        kind = i % 5
        with tiny_server.client(timeout=60) as client:
            if kind == 0:  # bad request
                return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10_000}).status_code
            if kind == 1:  # client gives up mid-stream
                body = {"prompt": prompt, "max_tokens": 64, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        break
                return 499
            if kind == 2:
                chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(1, 16)}
                return client.post("/v1/chat/completions", json=chat).status_code
            completion = {"prompt": prompt, "max_tokens": rng.randint(1, 24), "seed": i}
            return client.post("/v1/completions", json=completion).status_code

    with cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(200)))
    assert codes.count(400) == 40 and codes.count(200) == 120
    status = tiny_server.wait_idle()
    assert status["running"] == 0 and status["waiting"] == 0
    held = sum(-(-s["kv_tokens"] // status["kv_page_size"]) for s in status["slots"])
    assert status["kv_pages_used"] <= held  # nothing reserved beyond the cached prefixes
    with tiny_server.client() as client:
        assert client.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2}).status_code == 200


def test_openai_client_works(tiny_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 6
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 0
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_multi_model_routing_and_api_key(tiny_model, tmp_path):
    from pflash_plugin.testing import write_tiny_llama

    other = write_tiny_llama(tmp_path / "other.gguf", seed=5, vocab_extra=7)
    models = [
        {"model": str(tiny_model), "model_alias": "a", "n_ctx": 256, "max_concurrency": 2, "n_threads": 1,
         "n_threads_batch": 1},
        {"model": str(other), "model_alias": "b", "n_ctx": 256, "max_concurrency": 2, "n_threads": 1,
         "n_threads_batch": 1, "embedding": True},
    ]
    with live_server(models, api_key="sekret") as server:
        with server.client() as anonymous:
            assert anonymous.post("/v1/completions", json={"prompt": "x", "model": "a"}).status_code == 401
        with server.client(headers={"Authorization": "Bearer sekret"}) as client:
            body = {"prompt": "x", "max_tokens": 3, "temperature": 0}
            a = client.post("/v1/completions", json={**body, "model": "a"}).json()
            b = client.post("/v1/completions", json={**body, "model": "b"}).json()
            assert (a["model"], b["model"]) == ("a", "b")
            assert a["choices"][0]["text"] != b["choices"][0]["text"]
            missing = client.post("/v1/completions", json={"prompt": "x", "model": "c"})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
            assert missing.json()["error"]["param"] == "model" and "'c'" in missing.json()["error"]["message"]
            emb = client.post("/v1/embeddings", json={"input": ["x y", "z"], "model": "b"}).json()
            assert len(emb["data"]) == 2 and len(emb["data"][0]["embedding"]) == 64
            assert client.post("/v1/embeddings", json={"input": "x", "model": "a"}).status_code == 400
            empty = client.post("/v1/embeddings", json={"input": [], "model": "b"})
            assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
            status = client.get("/status").json()["models"]
            assert set(status) == {"a", "b"}


def test_tokenize_routes_and_metrics(tiny_server):
    with tiny_server.client() as client:
        tokens = client.post("/extras/tokenize", json={"input": "hello world"}).json()["tokens"]
        assert client.post("/extras/tokenize/count", json={"input": "hello world"}).json()["count"] == len(tokens)
        assert client.post("/extras/detokenize", json={"tokens": tokens}).json()["text"].strip() == "hello world"
        client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3})
        metrics = client.get("/metrics").text
        assert client.get("/health").json() == {"status": "ok"}
    for name in ("pflash_requests_total", "pflash_prompt_tokens_total", "pflash_generation_tokens_total",
                 "pflash_time_to_first_token_seconds_bucket", "pflash_inter_token_latency_seconds_bucket",
                 "pflash_kv_cache_usage_perc", "pflash_num_requests_running", "pflash_num_requests_waiting",
                 "pflash_cached_prompt_tokens_total"):
        assert name in metrics


def test_mirostat_min_tokens_and_seeded_sampling(tiny_server):
    with tiny_server.client() as client:
        body = {"prompt": "the sea", "max_tokens": 12, "temperature": 0.8, "seed": 3}
        a = [client.post("/v1/completions", json={**body, "mirostat_mode": mode}).json() for mode in (0, 1, 2)]
        assert all(r["usage"]["completion_tokens"] >= 1 for r in a)
        assert len({r["choices"][0]["text"] for r in a}) > 1  # mirostat changes the sampling
        bad = client.post("/v1/completions", json={**body, "mirostat_mode": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mirostat_mode"
        # min_tokens holds end-of-generation back: a logit bias that forces EOS still yields 3 tokens
        eos = {"2": 100.0}
        forced = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "logit_bias": eos}).json()
        held = client.post("/v1/completions",
                           json={"prompt": "x", "max_tokens": 10, "logit_bias": eos, "min_tokens": 3}).json()
        # ignore_eos (llama-server's, vLLM's): held back to max_tokens, on every route that takes it
        ignored = client.post("/v1/completions",
                              json={"prompt": "x", "max_tokens": 10, "logit_bias": eos, "ignore_eos": True}).json()
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 7, "logit_bias": eos, "ignore_eos": True}).json()
        native = client.post("/completion", json={"prompt": "x", "n_predict": 5, "logit_bias": eos,
                                                  "ignore_eos": True}).json()
    assert forced["usage"]["completion_tokens"] == 0 and forced["choices"][0]["finish_reason"] == "stop"
    assert held["usage"]["completion_tokens"] == 3
    assert ignored["usage"]["completion_tokens"] == 10 and ignored["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 7 and chat["choices"][0]["finish_reason"] == "length"
    assert native["tokens_predicted"] == 5 and native["generation_settings"]["ignore_eos"] is True


def test_streams_get_keepalive_comments_while_they_wait(tiny_model):
    model = {"model": str(tiny_model), "n_ctx": 512, "max_concurrency": 1, "n_threads": 1, "n_threads_batch": 1}
    with live_server([model], sse_ping_seconds=0.02) as server:
        with server.client() as client, cf.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(client.post, "/v1/completions", json={"prompt": "busy", "max_tokens": 480})
            deadline = time.time() + 10
            while server.status()["running"] == 0 and time.time() < deadline:
                time.sleep(0.005)  # until the one slot is taken: the stream below then waits
            comments_before_data = 0
            body = {"prompt": "wait", "max_tokens": 2, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith(":"):
                        comments_before_data += 1
                    elif line.startswith("data: "):
                        break
            assert busy.result().status_code == 200
    assert comments_before_data >= 1
