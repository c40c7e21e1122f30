"""Schemathesis against the server's own OpenAPI schema, on a real server with a tiny model: no 5xx,
no server_error inside a stream, no request left unanswered. Bounded here (derandomized, a fixed
number of cases per route); `python bench/soak.py --fuzz_examples N` runs more."""
from __future__ import annotations

import pytest

from conftest import live_server
from pflash_plugin.testing.fuzz import fuzz

pytest.importorskip("schemathesis")
KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    # one model: any generated "model" name reaches it, so the cases get past routing
    model = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 256, "max_concurrency": 2, "n_threads": 1,
             "n_threads_batch": 1}
    with live_server([model], api_key=KEY) as server:
        yield server


def test_generated_requests_get_no_server_error(fuzz_server):
    sent, findings = fuzz(fuzz_server.url, max_examples=80, headers={"Authorization": f"Bearer {KEY}"}, timeout_s=30)
    assert sent >= 200
    assert findings == [], findings[:5]
    with fuzz_server.client(headers={"Authorization": f"Bearer {KEY}"}) as client:  # and it still serves
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        status = client.get("/status").json()["models"]["tiny"]
    assert status["running"] == status["waiting"] == 0


def test_huge_logprobs_is_a_400_not_a_failed_request(fuzz_server):
    """Found by the fuzz: logprobs=100001 reached the sampler and failed the request with a 500."""
    with fuzz_server.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        completion = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 100001})
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "logprobs": True, "top_logprobs": 5000})
        most = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 20})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "logprobs"
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"
    assert most.status_code == 200 and len(most.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 20
