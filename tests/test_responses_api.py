"""The OpenAI Responses API (/v1/responses) through the `openai` SDK on a real server: text,
streamed and whole, function tools forced and auto, function_call_output in the next turn, a
json_schema text format, PFlash on a long input, and the refusals (stored state, other tools, parts
that are not text) in OpenAI's error shape."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from conftest import NOTES, TINY_PFLASH, WEATHER, hermes_model, live_server
from pflash_plugin.server.wire.responses_protocol import ResponsesRequest, chat_request

TOOL = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}
HUGE = {"type": "array", "items": {"type": "integer"}, "minItems": 10_000_000}  # over the schema bounds


@pytest.fixture(scope="module")
def server():
    with live_server([hermes_model("hermes"), hermes_model("pflash", **TINY_PFLASH)]) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_whole_and_streamed_agree_in_shape_and_count(sdk):
    whole = sdk.responses.create(model="hermes", input="Hello there", instructions="Be brief", max_output_tokens=6,
                                 temperature=0)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [item] = whole.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert whole.output_text == item.content[0].text != ""
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + 6

    events = list(sdk.responses.create(model="hermes", input="Hello there", instructions="Be brief",
                                       max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text  # greedy, alone: the same tokens
    assert final.output[0].id == events[2].item.id and final.usage.output_tokens == 6


def test_the_item_cut_by_max_output_tokens_is_incomplete_whole_and_streamed(sdk):
    """OpenAI marks the item being written when max_output_tokens ran out `incomplete`, as the response
    is, with its text so far; a finished item stays `completed` (the forced call below)."""
    whole = sdk.responses.create(model="hermes", input="Hello there", max_output_tokens=4, temperature=0)
    [item] = whole.output
    assert whole.status == item.status == "incomplete" and item.content[0].text == whole.output_text != ""

    events = list(sdk.responses.create(model="hermes", input="Hello there", max_output_tokens=4, temperature=0,
                                       stream=True))
    [added] = [e.item for e in events if e.type == "response.output_item.added"]
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert (added.status, done.status, final.status, final.output[0].status) == ("in_progress", "incomplete",
                                                                                  "incomplete", "incomplete")
    assert done.content[0].text == final.output_text == whole.output_text


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_a_forced_function_call_is_an_output_item_whole_and_streamed(sdk, choice):
    whole = sdk.responses.create(model="hermes", input="Weather in Paris?", tools=[TOOL], tool_choice=choice,
                                 max_output_tokens=200, temperature=1.0)
    assert whole.status == "completed"
    [call] = whole.output
    assert call.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    with sdk.responses.stream(model="hermes", input="Weather in Paris?", tools=[TOOL], tool_choice=choice,
                              max_output_tokens=200, temperature=1.0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    [call] = final.output
    assert final.status == "completed" and call.type == "function_call" and call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_auto_lets_the_model_choose_and_its_text_comes_back(sdk):
    """tool_choice auto: no grammar forces a call; the tiny model writes text, which is the answer."""
    reply = sdk.responses.create(model="hermes", input="Weather in Paris?", tools=[TOOL], tool_choice="auto",
                                 max_output_tokens=8, temperature=0)
    assert reply.status == "incomplete" and reply.output_text and reply.output[0].type == "message"
    assert reply.tools[0].name == "get_weather" and reply.tool_choice == "auto"


def test_a_function_call_output_is_read_in_the_next_turn(sdk):
    first = sdk.responses.create(model="hermes", input="Weather in Paris?", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    [call] = first.output
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    second = sdk.responses.create(model="hermes", input=turn, tools=[TOOL], max_output_tokens=4)
    without = sdk.responses.create(model="hermes", input=turn[:1], tools=[TOOL], max_output_tokens=4)
    assert second.usage.input_tokens > without.usage.input_tokens + 10  # the call and its result were rendered
    messages = chat_request(ResponsesRequest.model_validate({"input": turn, "instructions": "sys"})).messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2].tool_calls[0]["id"] == call.call_id and messages[3].content == "Sunny, 21 C"


def test_a_json_schema_format_constrains_the_text_and_the_sdk_parses_it(sdk):
    class Forecast(BaseModel):
        city: Literal["Paris", "Oslo"]

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    reply = sdk.responses.create(model="hermes", input="Which city?", max_output_tokens=100,
                                 text={"format": {"type": "json_schema", "name": "f", "schema": schema}})
    assert reply.status == "completed" and json.loads(reply.output_text)["city"] in {"Paris", "Oslo"}
    assert reply.text.format.type == "json_schema"
    parsed = sdk.responses.parse(model="hermes", input="Which city?", max_output_tokens=100, text_format=Forecast)
    assert isinstance(parsed.output_parsed, Forecast)


def test_the_developer_role_is_the_system_role(sdk):
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief"}]},
             {"role": "user", "content": "Hi"}]
    assert [m.role for m in chat_request(ResponsesRequest(input=items)).messages] == ["system", "user"]
    assert sdk.responses.create(model="hermes", input=items, max_output_tokens=2).usage.output_tokens == 2


def test_a_long_input_is_compressed_and_reported(sdk):
    reply = sdk.responses.create(model="pflash", input=NOTES + " When does the bridge open?", max_output_tokens=2)
    report = reply.usage.model_extra["timings"]["pflash"]
    assert report["status"] == "compressed" and report["kept_tokens"] < report["original_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.image_url"),  # no projector (tests/test_media_api.py)
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": HUGE}}}, "text.format"),
    ({}, "input"),
])
def test_bad_bodies_get_a_400_in_openai_shape_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "hermes", **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_an_unknown_model_is_a_404_and_the_server_goes_on(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="nope", input="hi", max_output_tokens=2)
    assert sdk.responses.create(model="hermes", input="hi", max_output_tokens=2).usage.output_tokens == 2
