"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the `anthropic` SDK on
a real server: a system prompt, several turns, stop sequences, streaming events, a forced tool call
answered in the next turn with a tool_result, token counts, PFlash on a long conversation, and bad
input in Anthropic's error shape."""
from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import pytest

from conftest import NOTES, TINY_PFLASH, WEATHER, hermes_model, live_server
from pflash_plugin.server.wire.anthropic_protocol import MessagesRequest, chat_request

TOOL = {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0.0}  # sampling parameters travel in extra_body: this SDK no longer takes them


@pytest.fixture(scope="module")
def server():
    with live_server([hermes_model("hermes"), hermes_model("pflash", **TINY_PFLASH)]) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_message_whole_and_streamed_with_a_system_prompt_and_turns(sdk):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
             {"role": "user", "content": [{"type": "text", "text": "How"}, {"type": "text", "text": "are you?"}]}]
    kw = dict(model="hermes", max_tokens=6, system=[{"type": "text", "text": "Be brief"}], messages=turns,
              extra_body=GREEDY)
    whole = sdk.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.usage.output_tokens == 6
    counted = sdk.messages.count_tokens(model="hermes", system=kw["system"], messages=turns).input_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted

    with sdk.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == block.text  # greedy, alone: the same tokens
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert "text" in kinds  # the SDK's own text events, from the text_delta events
    raw = _event_names(sdk, {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY})
    assert raw[:3] == ["message_start", "ping", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def _event_names(sdk, body: dict) -> list[str]:
    """The names of the SSE events of a streamed message, as sent (the SDK drops the pings)."""
    with httpx.stream("POST", f"{sdk.base_url}/v1/messages", json={**body, "stream": True}, timeout=60) as reply:
        return [line[len("event: "):] for line in reply.iter_lines() if line.startswith("event: ")]


def test_a_stop_sequence_ends_the_message_and_is_named(sdk):
    kw = dict(model="hermes", max_tokens=12, messages=[{"role": "user", "content": "Go on"}], extra_body=GREEDY)
    text = sdk.messages.create(**kw).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = sdk.messages.create(stop_sequences=["\x00never", stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with sdk.messages.stream(stop_sequences=[stop], **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_call_is_a_tool_use_block_whole_and_streamed(sdk, choice):
    kw = dict(model="hermes", max_tokens=200, tools=[TOOL], tool_choice=choice, messages=ASK,
              extra_body={"temperature": 1.0, "top_k": 0})
    whole = sdk.messages.create(**kw)
    [use] = whole.content
    assert whole.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    with sdk.messages.stream(**kw) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    [use] = final.content
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and json.loads(partial) == use.input
    jsonschema.validate(use.input, WEATHER)


def test_auto_lets_the_model_choose_and_its_text_comes_back(sdk):
    reply = sdk.messages.create(model="hermes", max_tokens=8, tools=[TOOL], tool_choice={"type": "auto"},
                                messages=ASK, extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.content[0].type == "text" and reply.content[0].text


def test_a_tool_result_answers_the_call_in_the_next_turn(sdk):
    first = sdk.messages.create(model="hermes", max_tokens=200, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=ASK)
    [use] = first.content
    results = [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"},
               {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "Dry"}]},
               {"type": "text", "text": "And tomorrow?"}]
    turns = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
             {"role": "user", "content": results}]
    second = sdk.messages.create(model="hermes", max_tokens=4, tools=[TOOL], messages=turns)
    assert second.stop_reason == "max_tokens" and second.usage.output_tokens == 4
    assert sdk.messages.count_tokens(model="hermes", tools=[TOOL], messages=turns).input_tokens > \
        sdk.messages.count_tokens(model="hermes", tools=[TOOL], messages=ASK).input_tokens + 10
    chat = chat_request(MessagesRequest.model_validate({"max_tokens": 1, "messages": turns}))
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool", "user"]
    assert chat.messages[1].tool_calls[0]["id"] == use.id and chat.messages[2].content == "Sunny, 21 C"
    assert chat.messages[3].content == "Dry" and chat.messages[4].content == "And tomorrow?"


def test_an_output_format_constrains_the_text_to_its_schema(sdk):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    reply = sdk.messages.create(model="hermes", max_tokens=100, messages=ASK,
                                extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_a_long_conversation_is_compressed_and_reported(sdk):
    reply = sdk.messages.create(model="pflash", max_tokens=2,
                                messages=[{"role": "user", "content": NOTES + " When does the bridge open?"}])
    report = reply.usage.model_extra["timings"]["pflash"]
    assert report["status"] == "compressed" and report["kept_tokens"] < report["original_tokens"]


def test_a_stream_left_early_frees_its_slot(server):
    body = {"model": "hermes", "max_tokens": 2000, "stream": True, "messages": ASK}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=60) as reply:
        lines = reply.iter_lines()  # kept: a collected line iterator closes the stream
        next(line for line in lines if line.startswith("event: content_block_delta"))
        assert server.status("hermes")["running"] == 1
    deadline = time.time() + 10
    while server.status("hermes")["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert server.status("hermes")["running"] == 0


def test_a_plain_text_document_is_read_as_its_text(sdk):
    """Anthropic's document block with a `text` or `content` source: the model reads its text (with
    its title first), as if sent as text blocks."""
    text = "The bridge opens at dawn."
    as_text = [{"role": "user", "content": [{"type": "text", "text": "Report"}, {"type": "text", "text": text}]}]
    sources = [{"type": "text", "media_type": "text/plain", "data": text},
               {"type": "content", "content": [{"type": "text", "text": text}]}]
    expected = sdk.messages.count_tokens(model="hermes", messages=as_text).input_tokens
    for source in sources:
        doc = [{"role": "user", "content": [{"type": "document", "title": "Report", "source": source}]}]
        assert sdk.messages.count_tokens(model="hermes", messages=doc).input_tokens == expected, source
        assert sdk.messages.create(model="hermes", max_tokens=2, messages=doc).usage.output_tokens == 2


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "mystery"}]}]},
     400, "invalid_request_error", "mystery"),
    ({"max_tokens": 4, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     400, "invalid_request_error", "nope"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "tools.0"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     400, "invalid_request_error", "tool_use_id"),
    ({"model": "nope", "max_tokens": 4, "messages": ASK}, 404, "not_found_error", "nope"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "AA=="}}]}]},
     400, "invalid_request_error", "messages.0.content.0.source: a base64 document (a PDF) is not read"),
    # a block after a tool_result is named by its index in the client's content (not among the text blocks)
    ({"max_tokens": 4, "tools": [TOOL], "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "mystery"}]}]},
     400, "invalid_request_error", "messages.2.content.1: a block of type 'mystery'"),
    ({"max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 10_000_000}}}},
     400, "invalid_request_error", "output_config.format: minItems"),
])
def test_bad_input_gets_anthropics_error_shape(server, body, status, kind, words):
    reply = httpx.post(f"{server.url}/v1/messages", json={"model": "hermes", **body}, timeout=30)
    assert reply.status_code == status, reply.text
    payload = reply.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind and words in payload["error"]["message"]


def test_unknown_paths_and_methods_under_messages_answer_in_anthropics_shape(server):
    for method, path, status in [("POST", "/v1/messages/nope", 404), ("GET", "/v1/messages", 405)]:
        reply = httpx.request(method, f"{server.url}{path}", timeout=30)
        assert reply.status_code == status and reply.json()["type"] == "error", (path, reply.text)
        assert reply.json()["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    elsewhere = httpx.post(f"{server.url}/v1/nope", timeout=30).json()
    assert "type" not in elsewhere and elsewhere["error"]["message"]  # OpenAI's shape elsewhere


def test_the_sdk_raises_its_own_errors_and_the_server_goes_on(sdk):
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(model="hermes", max_tokens=4, messages=ASK, tools=[TOOL],
                            tool_choice={"type": "tool", "name": "nope"})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as caught:  # over the model's context: refused by admission
        sdk.messages.create(model="hermes", max_tokens=4, messages=[{"role": "user", "content": "x " * 5_000}])
    assert caught.value.body["type"] == "error" and "max_ctx" in caught.value.body["error"]["message"]
    assert sdk.messages.create(model="hermes", max_tokens=2, messages=ASK).usage.output_tokens == 2
