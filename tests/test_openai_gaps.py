"""The OpenAI shapes that llama.cpp's server suite found missing, through the `openai` SDK on a real
server: content as a list of text parts, response_format json_schema, embeddings of token ids, and
base64 embeddings."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from conftest import live_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_model):
    # n_ctx 512: room for the system prompt that describes the tools to a template that renders none
    settings = {"model": str(tiny_model), "model_alias": "tiny", "n_ctx": 512, "max_concurrency": 2,
                "n_threads": 1, "n_threads_batch": 1, "embedding": True}
    with live_server([settings]) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tokens_of(server, text: str) -> list[int]:
    with server.client() as client:
        return client.post("/extras/tokenize", json={"input": text}).json()["tokens"]


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def test_content_as_text_parts_is_the_joined_text_for_every_role(sdk):
    as_parts = [
        {"role": "system", "content": parts("be brief", "be kind")},
        {"role": "user", "content": parts("what is", "the time")},
        {"role": "assistant", "content": parts("let me look")},
        {"role": "tool", "tool_call_id": "call_1", "content": parts("noon")},
    ]
    as_text = [{**m, "content": "\n".join(p["text"] for p in m["content"])} for m in as_parts]
    by_parts = sdk.chat.completions.create(model="tiny", messages=as_parts, max_tokens=6, temperature=0)
    by_text = sdk.chat.completions.create(model="tiny", messages=as_text, max_tokens=6, temperature=0)
    assert by_parts.usage.prompt_tokens == by_text.usage.prompt_tokens
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content


@pytest.mark.parametrize("message, field", [
    ({"role": "user", "content": [*parts("look"), {"type": "video_url", "video_url": {"url": "http://x/a.mp4"}}]},
     "messages.1.content.1"),
    ({"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, "messages.1.content.0"),
])
def test_a_part_that_is_not_text_is_refused_by_its_field(sdk, message, field):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}, message], max_tokens=2)
    error = caught.value.body
    assert error["param"] == f"{field}.type"
    assert error["message"].startswith(field) and repr(message["content"][-1]["type"]) in error["message"]
    assert "system" not in error["message"]


def test_an_unknown_role_is_named_as_such(server):
    with server.client() as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "narrator", "content": "x"}]})
    assert reply.status_code == 400 and "narrator" in reply.json()["error"]["message"]


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_response_format_constrains_the_output(sdk, strict):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    reply = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": strict}},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content) in ({"answer": "yes"}, {"answer": "no"})


def test_json_schema_without_its_schema_object_is_refused(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema"}
        )
    assert caught.value.body["param"] == "response_format.json_schema"


def embed(sdk, inputs) -> list[list[float]]:
    reply = sdk.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    return [item.embedding for item in sorted(reply.data, key=lambda item: item.index)]


def test_embeddings_of_token_ids_match_the_text(sdk, server):
    first, second = tokens_of(server, "the river"), tokens_of(server, "a mountain far away")
    [by_text] = embed(sdk, "the river")
    [by_ids] = embed(sdk, first)
    assert by_ids == pytest.approx(by_text)
    both = sdk.embeddings.create(model="tiny", input=[first, second], encoding_format="float")
    assert [item.index for item in both.data] == [0, 1]
    assert both.usage.prompt_tokens == len(first) + len(second)
    assert both.data[1].embedding == pytest.approx(embed(sdk, "a mountain far away")[0])


@pytest.mark.parametrize("inputs", [[1, 10**9], [[1, 2], [-3]]])
def test_embeddings_of_token_ids_outside_the_vocabulary_are_refused(sdk, inputs):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.embeddings.create(model="tiny", input=inputs)
    assert caught.value.body["param"] == "input" and "vocabulary" in caught.value.body["message"]


def test_base64_embeddings_are_little_endian_float32(sdk):
    [floats] = embed(sdk, "encode me")
    raw = sdk.embeddings.create(model="tiny", input="encode me", encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    assert np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist() == pytest.approx(floats)
    # the SDK asks for base64 by default and decodes it
    assert sdk.embeddings.create(model="tiny", input="encode me").data[0].embedding == pytest.approx(floats)


def sse_chunks(server, body: dict) -> list[dict]:
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "noop", "parameters": {}}}]])
def test_a_streamed_chat_sends_the_role_alone_and_no_empty_content_delta(server, tools):
    # llama.cpp's server suite (as stock passes it) checks that every content delta is non-empty
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "stream": True, **({"tools": tools} if tools else {})}
    deltas = [chunk["choices"][0]["delta"] for chunk in sse_chunks(server, body) if chunk["choices"]]
    assert deltas[0] == {"role": "assistant"}
    assert all("role" not in delta for delta in deltas[1:])
    assert all(delta["content"] for delta in deltas if "content" in delta)
    text = "".join(delta.get("content", "") for delta in deltas)
    body.pop("stream")
    with server.client() as client:
        assert text == client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
