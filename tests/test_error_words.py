"""Issue 49: errors name the client's fields in the client's API, never a library's internals:
Responses says max_output_tokens, Anthropic says tool_choice `any`, `param` holds no pydantic
union labels, a schema of the wrong shape is a 400 naming its keyword, a tool_result must answer
a tool_use, and a json_schema format without a schema is any JSON object on every route."""
from __future__ import annotations

import json

import httpx
import pytest

from conftest import WEATHER, hermes_model, live_server

ASK = [{"role": "user", "content": "weather?"}]
BAD_SCHEMA = {"type": "object", "properties": [1, 2]}


@pytest.fixture(scope="module")
def server():
    with live_server([hermes_model("hermes")]) as live:
        yield live


def openai_error(server, path: str, body: dict) -> dict:
    reply = httpx.post(server.url + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def anthropic_error(server, body: dict) -> str:
    reply = httpx.post(server.url + "/v1/messages", json={"model": "hermes", "max_tokens": 8, **body}, timeout=60)
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    return reply.json()["error"]["message"]


def test_responses_context_errors_name_max_output_tokens(server):
    error = openai_error(server, "/v1/responses", {"input": "hi", "max_output_tokens": 100_000})
    assert "max_output_tokens (100000)" in error["message"] and "max_tokens" not in error["message"], error
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                              "input"), error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK}, "messages"),
    ("/v1/completions", {"prompt": "weather?"}, "prompt"),
])
def test_a_prompt_over_the_context_is_openais_context_length_exceeded(server, path, body, param):
    """OpenAI's answer: an invalid_request_error with code context_length_exceeded and the prompt's field."""
    error = openai_error(server, path, {"model": "hermes", "max_tokens": 100_000, **body})
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                              param), error


HUGE_TEXT = "x" * 100_000  # over max_ctx (2048) x the longest piece (12 characters) whatever its tokens


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE_TEXT}]}, "messages"),
    ("/v1/completions", {"prompt": HUGE_TEXT}, "prompt"),
    ("/v1/responses", {"input": HUGE_TEXT}, "input"),
])
def test_a_text_too_long_to_tokenize_is_context_length_exceeded_too(server, path, body, param):
    """Refused before it is tokenized (runtime/text_limits.py), with the code admission gives."""
    error = openai_error(server, path, {"model": "hermes", **body})
    assert "characters are over max_ctx" in error["message"], error
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                              param), error


@pytest.mark.parametrize("body, said", [
    ({"messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice: type 'any' needs tools"),
    ({"messages": ASK, "tools": [{"name": "w", "input_schema": WEATHER}], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "tool_choice 'any' makes the answer a tool call: it cannot be combined with output_config.format"),
    ({"messages": ASK, "tools": [{"name": "w", "input_schema": BAD_SCHEMA}], "tool_choice": {"type": "any"}},
     "tools.0.input_schema.properties: must be an object of schemas, not list"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: Input should be a valid string or a valid"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "w", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zzz", "content": "x"}]}]},
     "messages.2.content.0: tool_result block for tool_use_id 'zzz', which no tool_use block of the previous"),
])
def test_anthropic_errors_speak_anthropic(server, body, said):
    message = anthropic_error(server, body)
    assert said in message and "required" not in message, message


@pytest.mark.parametrize("body, param, said", [
    ({"tool_choice": "bogus", "tools": [{"type": "function", "function": {"name": "w", "parameters": WEATHER}}]},
     "tool_choice", "Input should be 'none', 'auto' or 'required' or a valid dictionary"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "a valid string or a valid list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "Field required"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "w", "parameters": BAD_SCHEMA}}]},
     "tools.0.function.parameters.properties", "must be an object of schemas, not list"),
])
def test_chat_params_are_the_clients_fields(server, body, param, said):
    error = openai_error(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert error["param"] == param and said in error["message"], error


def test_responses_names_a_tools_schema_as_sent(server):
    tool = {"type": "function", "name": "w", "parameters": BAD_SCHEMA}
    error = openai_error(server, "/v1/responses", {"input": "hi", "tools": [tool], "tool_choice": "required"})
    assert error["param"] == "tools.0.parameters.properties" and "must be an object of schemas" in error["message"]


def test_a_schema_of_the_wrong_shape_in_response_format_names_its_keyword(server):
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "items": 3}}}
    error = openai_error(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": form})
    assert error["param"] == "response_format.items" and "must be a schema or an array of schemas" in error["message"]


NAMED_ONLY = {"type": "json_schema", "json_schema": {"name": "x"}}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "response_format": NAMED_ONLY}),
    ("/v1/chat/completions", {"messages": ASK, "response_format": NAMED_ONLY}),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}),
])
def test_json_schema_without_a_schema_is_any_json_object_on_every_route(server, path, body):
    reply = httpx.post(server.url + path, json={"model": "hermes", "temperature": 0, **body,
                                                 "max_output_tokens" if "input" in body else "max_tokens": 6},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    text = (answer["output_text"] if "output_text" in answer else answer["choices"][0].get("text")
            or answer["choices"][0]["message"]["content"])
    assert text.lstrip().startswith("{"), text


# A new user's neighbours of the documented bodies: a field of the wrong type names that field as
# sent, in each API (union members' errors: the one that reached into the client's shape).
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                              "max_tokens": 4}, "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "hi"}]}], "max_tokens": 4},
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "function"},
                              "tools": [{"type": "function", "function": {"name": "w"}}]}, "tool_choice.function"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input.0.content.0.text"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []], "max_tokens": 4}, "prompt.1"),
])
def test_a_wrong_shape_names_the_clients_field(server, path, body, param):
    error = openai_error(server, path, body)
    assert error["param"] == param and error["message"].startswith(param + ":"), error
    assert "not taken here" not in error["message"] and "instance of" not in error["message"], error


def test_a_prompt_of_mixed_shapes_names_the_shapes(server):
    error = openai_error(server, "/v1/completions", {"prompt": [1, "a"], "max_tokens": 4})
    assert error["param"] == "prompt" and "a list of token ids" in error["message"], error


@pytest.mark.parametrize("prompt, bad, param", [
    ([1, 2, -3, 4, -5], -3, "prompt"),
    ([1, 10**9, 3, 10**6], 10**9, "prompt"),
    ([[1, 2], [3, 10**6]], 10**6, "prompt"),
])
def test_a_token_id_outside_the_vocabulary_is_named(server, prompt, bad, param):
    """The first id outside the vocabulary is named (the bounds are read with min and max)."""
    error = openai_error(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert error["param"] == param and f"token id {bad} is outside the vocabulary" in error["message"], error
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_an_anthropic_text_block_without_text_names_its_text(server):
    message = anthropic_error(server, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert message.startswith("messages.0.content.0.text:"), message


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "n": 100}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "n": 50}),
])
def test_more_choices_than_slots_and_queue_name_n(server, path, body):
    """2 slots + 64 queued: 100 choices can never run, a 400 naming the client's `n`."""
    error = openai_error(server, path, body)
    assert error["param"] == "n" and "can never be served together" in error["message"], error


@pytest.mark.parametrize("headers", [{"content-type": "application/x-www-form-urlencoded"}, {}])
def test_a_json_body_without_a_json_content_type_says_so(server, headers):
    """curl -d without -H 'Content-Type: application/json' (a form's type), or no type: the 400
    says what to send (FastAPI's own error said "Input should be a valid dictionary")."""
    raw = json.dumps({"prompt": "hi", "max_tokens": 2})
    reply = httpx.post(server.url + "/v1/completions", content=raw, headers=headers, timeout=60)
    assert reply.status_code == 400 and "Content-Type: application/json" in reply.json()["error"]["message"]
    reply = httpx.post(server.url + "/v1/messages", content=json.dumps({"max_tokens": 2, "messages": ASK}),
                       headers=headers, timeout=60)
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    assert "Content-Type: application/json" in reply.json()["error"]["message"]


@pytest.mark.parametrize("raw, said", [("", "none was sent"), ("null", "got null"), ("[1]", "got an array")])
def test_a_body_that_is_not_an_object_says_so(server, raw, said):
    reply = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["message"] == f"the body must be a JSON object ({said})"
