"""What a newcomer's OpenAI client sends, on a real server through the `openai` SDK and LangChain's
ChatOpenAI: max_completion_tokens, a function without parameters, the developer role, complete
parallel calls at max_tokens, models.retrieve, a json_schema on /v1/completions, unknown routes
in OpenAI's error shape, and every error a route answers counted in pflash_errors_total."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from conftest import live_server
from pflash_plugin.testing import cached_tiny_llama
from pflash_plugin.testing.tool_templates import TOOL_TEMPLATES

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "What time is it in Oslo?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Time of day", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
# two complete calls in the hermes syntax, then text that never ends (no rule lets it stop): the
# answer runs to max_tokens after its calls, as a small model's does
CALLS_THEN_TEXT = (
    'root ::= "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"UTC\\"}}\\n</tool_call>\\n'
    '<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"CET\\"}}\\n</tool_call>\\n" more\n'
    'more ::= [a-z] more'
)


@pytest.fixture(scope="module")
def server():
    def model(alias: str, **kw) -> dict:
        return {"model": str(cached_tiny_llama(**kw)), "model_alias": alias, "n_ctx": 1024, "max_concurrency": 2,
                "n_threads": 1, "n_threads_batch": 1}

    with live_server([model("tiny"), model("hermes", chat_template=TOOL_TEMPLATES["hermes"])]) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_max_completion_tokens_is_max_tokens(sdk):
    reply = sdk.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=5, temperature=0)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    chunks = list(sdk.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=3, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3
    same = sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, max_completion_tokens=5)
    assert same.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, max_completion_tokens=6)
    assert caught.value.body["param"] == "max_completion_tokens" and "differ" in caught.value.body["message"]


def test_langchain_chat_openai_with_tools_stops_at_max_tokens(server):
    """ChatOpenAI sends max_completion_tokens (never max_tokens); ignored, the answer ran to max_ctx."""
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="hermes", max_tokens=7,
                                       temperature=0, max_retries=0)
    tool = {"type": "function", "function": {"name": "get_time", "description": "Time of day",
                                             "parameters": TIME_TOOL["function"]["parameters"]}}
    reply = chat.bind_tools([tool]).invoke("What time is it in Oslo?")
    assert reply.response_metadata["token_usage"]["completion_tokens"] == 7
    assert reply.response_metadata["finish_reason"] == "length"


def test_a_function_without_parameters_takes_no_arguments(sdk):
    now = {"type": "function", "function": {"name": "now", "description": "The current time"}}
    forced = sdk.chat.completions.create(model="hermes", messages=ASK, tools=[now], tool_choice="required",
                                         max_tokens=60, temperature=0)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("now", {})]
    free = sdk.chat.completions.create(model="tiny", messages=ASK, tools=[now, TIME_TOOL], max_tokens=4)
    assert free.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_complete_parallel_calls_cut_at_max_tokens_finish_as_tool_calls(sdk, stream):
    kw = dict(model="hermes", messages=ASK, tools=[TIME_TOOL], max_tokens=200, temperature=0,
              extra_body={"grammar": CALLS_THEN_TEXT})
    if stream:
        calls: dict[int, str] = {}
        finish = None
        for chunk in sdk.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    calls[delta.index] = calls.get(delta.index, "") + (delta.function.arguments or "")
                finish = choice.finish_reason or finish
        arguments = [calls[i] for i in sorted(calls)]
    else:
        reply = sdk.chat.completions.create(**kw)
        assert reply.usage.completion_tokens == 200  # the text after the calls ran to max_tokens
        finish = reply.choices[0].finish_reason
        arguments = [c.function.arguments for c in reply.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert [json.loads(a) for a in arguments] == [{"zone": "UTC"}, {"zone": "CET"}]


def test_the_developer_role_is_the_system_role(sdk):
    """The Hermes template puts the system message in its tools block (a developer one would get
    a turn of its own), so the prompts are the same only when developer is system."""
    def ask(role: str):
        return sdk.chat.completions.create(model="hermes", max_tokens=6, temperature=0, tools=[TIME_TOOL],
                                           messages=[{"role": role, "content": "Answer in one word."}, *ASK])

    as_developer, as_system = ask("developer"), ask("system")
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_models_retrieve_names_a_served_model_and_404s_another(sdk):
    assert sdk.models.retrieve("hermes").id == "hermes"
    assert {m.id for m in sdk.models.list().data} == {"tiny", "hermes"}
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found" and "gpt-4o" in caught.value.body["message"]


def test_a_json_schema_on_completions_constrains_the_text(sdk):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    for seed in range(3):
        reply = sdk.completions.create(model="tiny", prompt="Is the sky blue? Answer in JSON:", max_tokens=60,
                                       temperature=1.0, seed=seed, extra_body={"response_format": {
                                           "type": "json_schema", "json_schema": {"name": "v", "schema": schema}}})
        assert reply.choices[0].finish_reason == "stop"
        assert json.loads(reply.choices[0].text) in ({"answer": "yes"}, {"answer": "no"})
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="tiny", prompt="x", extra_body={"response_format": {"type": "json_schema"}})
    assert caught.value.body["param"] == "response_format.json_schema"


@pytest.mark.parametrize("method, path, status, says", [
    ("GET", "/v1/nope", 404, "Invalid URL (GET /v1/nope)"),
    ("POST", "/v1/chat/completion", 404, "Invalid URL (POST /v1/chat/completion)"),
    ("GET", "/v1/chat/completions", 405, "Method GET is not allowed for /v1/chat/completions (allowed: POST)"),
])
def test_unknown_routes_and_methods_answer_in_openai_error_shape(server, method, path, status, says):
    reply = httpx.request(method, server.url + path, timeout=30)
    assert reply.status_code == status
    assert reply.json() == {"error": {"message": says, "type": "invalid_request_error", "param": None, "code": None}}


def _errors(server, model: str, status: int) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.search(rf'^pflash_errors_total{{model_name="{model}",status="{status}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_every_error_a_route_answers_is_counted_once(server):
    with server.client() as client:
        def counted(body: dict, model: str, status: int) -> float:
            before = _errors(server, model, status)
            assert client.post("/v1/chat/completions", json=body).status_code == status
            return _errors(server, model, status) - before

        # the body fails validation (pydantic), a check after it, a refusal by the engine (counted where made)
        assert counted({"model": "hermes", "messages": [{"role": "user"}], "temperature": "hot"}, "hermes", 400) == 1
        assert counted({"model": "tiny", "messages": []}, "tiny", 400) == 1
        assert counted({"model": "tiny", "messages": ASK, "max_tokens": 5000}, "tiny", 400) == 1
        assert counted({"model": "gpt-4o", "messages": ASK}, "unknown", 404) == 1


def test_the_demo_model_answers_a_chat(demo_model):
    """The quick start's model, a base Gemma 3 without a chat template: in llama-2's format (stock's
    fallback) every reply was empty; with Gemma 3's template it answers, and its system prompt (which
    llama_cpp's `gemma` format drops) opens the user's turn."""
    ask = [{"role": "user", "content": "Name three colors."}]
    with live_server([{"n_ctx": 1024, "max_concurrency": 1}]) as live:  # no model: the demo
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        reply = sdk.chat.completions.create(model="demo", messages=ask, max_tokens=12, temperature=0)
        told = sdk.chat.completions.create(model="demo", max_tokens=1, messages=[
            {"role": "system", "content": "Answer in French."}, *ask])
    assert reply.choices[0].message.content.strip() and reply.usage.completion_tokens > 1
    assert told.usage.prompt_tokens > reply.usage.prompt_tokens + 3


def test_null_sampling_fields_take_their_defaults(server, sdk):
    """OpenAI reads null as the default, and the SDK sends null for an argument given as None
    (wrappers pass `temperature=kwargs.get("temperature")`); stock's types refused it."""
    reply = sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, temperature=None, top_p=None)
    assert reply.choices[0].finish_reason == "length"
    for path, body in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "hi", "echo": None})):
        nulls = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "stream": None, "priority": None}
        answer = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 3, **body, **nulls}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
    for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
                       ("/v1/messages", {"messages": ASK, "max_tokens": 3})):
        answer = httpx.post(server.url + path, json={"model": "tiny", **body, "stream": None, "temperature": None},
                            timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["output_tokens"] == 3, answer.text
