"""OpenAI compatibility over HTTP with the `openai` SDK: token-id prompts, n > 1, invalid bodies
(400 with OpenAI's error shape, never 422), and the typed OpenAPI schema."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def tokens_of(server, text: str) -> list[int]:
    with server.client() as client:
        return client.post("/extras/tokenize", json={"input": text}).json()["tokens"]


def test_prompt_as_token_ids_matches_the_text_prompt(sdk, tiny_server):
    text = "the river flows"
    ids = tokens_of(tiny_server, text)
    by_text = sdk.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0)
    by_ids = sdk.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echoed = sdk.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(text)


def test_a_list_of_token_id_prompts_gets_one_choice_each(sdk, tiny_server):
    a, b = tokens_of(tiny_server, "first prompt"), tokens_of(tiny_server, "a second, longer prompt")
    reply = sdk.completions.create(model="tiny", prompt=[a, b], max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.prompt_tokens == len(a) + len(b)
    alone = sdk.completions.create(model="tiny", prompt=b, max_tokens=4, temperature=0)
    assert reply.choices[1].text == alone.choices[0].text


def test_n_samples_of_one_completion_prompt(sdk, tiny_server):
    prompt = "count the stars in the sky"
    n_prompt = len(tokens_of(tiny_server, prompt))
    reply = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, seed=5, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text != reply.choices[1].text  # sample i uses seed + i
    assert reply.usage.prompt_tokens == n_prompt  # counted once, as OpenAI does
    assert reply.usage.completion_tokens == 24 and reply.usage.total_tokens == n_prompt + 24
    chunks = list(sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, seed=5, n=2,
                                         stream=True, stream_options={"include_usage": True}))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert streamed == {0: reply.choices[0].text, 1: reply.choices[1].text}  # same seeds, same samples
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 24
    assert len({c.id for c in chunks}) == 1  # the usage chunk's id too, as OpenAI sends it
    assert tiny_server.wait_idle()["running"] == 0


def test_n_samples_streamed_chat(sdk, tiny_server):
    stream = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.9, seed=1, n=2,
        stream=True, stream_options={"include_usage": True},
    )
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1} and all(texts.values())
    assert usage is not None and usage.completion_tokens <= 12
    whole = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in whole.choices)


@pytest.mark.parametrize("call, param", [
    (lambda sdk: sdk.completions.create(model="tiny", prompt="x", top_p=3), "top_p"),
    (lambda sdk: sdk.completions.create(model="tiny", prompt="x", n=0), "n"),
    (lambda sdk: sdk.completions.create(model="tiny", prompt=["x"] * 3, n=50), "n"),
    (lambda sdk: sdk.completions.create(model="tiny", prompt=[1, 10**9]), "prompt"),
    (lambda sdk: sdk.completions.create(model="tiny", prompt="x", extra_body={"temperature": "hot"}), "temperature"),
    (lambda sdk: sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             extra_body={"max_tokens": "many"}), "max_tokens"),
    (lambda sdk: sdk.chat.completions.create(model="tiny", messages=[]), "messages"),
])
def test_invalid_bodies_get_400_with_the_openai_error_shape(sdk, call, param):
    with pytest.raises(openai.BadRequestError) as caught:
        call(sdk)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param) and error["message"]


def test_malformed_json_and_wrong_shapes_are_400_too(tiny_server):
    with tiny_server.client() as client:
        for path, raw in [("/v1/completions", b"{not json"), ("/v1/chat/completions", b"[1, 2]"),
                          ("/extras/tokenize", b'{"input": 5}'), ("/v1/embeddings", b"{}")]:
            reply = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert reply.status_code == 400, (path, reply.text)
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_openapi_schema_is_typed_and_documents_no_422(tiny_server):
    with tiny_server.client() as client:
        schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for name in ("CompletionResponse", "ChatCompletionResponse", "CompletionRequest", "ChatCompletionRequest",
                 "ErrorResponse", "Usage"):
        assert name in components
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert completions["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    assert "text/event-stream" in completions["200"]["content"]
    assert "422" not in json.dumps(
        {p: {m: op["responses"] for m, op in ops.items()} for p, ops in schema["paths"].items()}
    )
    prompt_types = json.dumps(components["CompletionRequest"]["properties"]["prompt"])
    assert '"integer"' in prompt_types
