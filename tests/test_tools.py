"""Tool calling through the `openai` SDK on a real server: tiny models that carry the Hermes/Qwen,
Llama 3.x and Mistral chat templates (and one with none), forced calls whose arguments parse and
validate against the function's schema, streamed and not; the readers that parse what a model
writes; the refusals."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import live_server
from pflash_plugin.server.runtime.prompts import chat_formatter
from pflash_plugin.server.wire.responses import ChatChoice
from pflash_plugin.server.preparation.tool_requests import ToolRequest
from pflash_plugin.chat.tool_calls import GENERIC, HERMES, LLAMA3, MISTRAL, ToolCallReader, syntax_for
from pflash_plugin.testing import CHATML_TEMPLATE, cached_tiny_llama
from pflash_plugin.testing.tool_templates import TOOL_TEMPLATES

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time of day", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = ["hermes", "llama3", "mistral", "chatml"]  # chatml: a template that renders no tools
# a template that renders the tools in a format the server does not know
ODD_TEMPLATE = "{% if tools %}<|im_start|>functions\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + CHATML_TEMPLATE


@pytest.fixture(scope="module")
def server():
    def model(alias: str, **kw) -> dict:
        return {"model": str(cached_tiny_llama(**kw)), "model_alias": alias, "n_ctx": 1024, "max_concurrency": 2,
                "n_threads": 1, "n_threads_batch": 1}

    models = [model(name, chat_template=template) for name, template in TOOL_TEMPLATES.items()]
    with live_server([*models, model("chatml"), model("odd", chat_template=ODD_TEMPLATE)]) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """Tool calls accumulated from the deltas by index, as OpenAI clients do."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def _check(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_named_call_is_forced_and_its_arguments_validate(sdk, family, stream):
    """4 templates x 2 ways x 3 seeds: 24 forced calls at temperature 1, every one parses and validates."""
    for seed in range(3):
        kw = dict(model=family, messages=ASK, tools=TOOLS, tool_choice=_named("get_weather"), max_tokens=300,
                  temperature=1.0, seed=seed)
        if stream:
            calls, finish, content = _streamed_calls(sdk.chat.completions.create(stream=True, **kw))
        else:
            choice = sdk.chat.completions.create(**kw).choices[0]
            finish, content = choice.finish_reason, choice.message.content or ""
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in choice.message.tool_calls or []]
        assert finish == "tool_calls" and content == ""
        assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
        assert _check("get_weather", calls[0]["arguments"])["city"] in {"Paris", "Oslo", "Lima"}


@pytest.mark.parametrize("family", FAMILIES)
def test_required_calls_one_of_the_tools_and_parallel_false_allows_one(sdk, family):
    for seed in range(4):
        reply = sdk.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        assert call.name in SCHEMAS
        _check(call.name, call.arguments)
    # and either may be called: the grammar offers both
    grammar = ToolRequest(syntax_for(TOOL_TEMPLATES.get(family)), TOOLS, list(SCHEMAS), False).grammar()
    assert grammar is not None and all(f'\\"{name}\\"' in grammar for name in SCHEMAS)


def test_a_conversation_with_calls_and_results_renders_in_every_template(sdk):
    call = {"id": "abcdef123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "abcdef123", "content": "rain"}]
    for family in FAMILIES:
        reply = sdk.chat.completions.create(model=family, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length"


def test_a_template_with_an_unknown_tool_format_gets_the_tools_in_the_system_prompt_only(sdk):
    assert syntax_for(ODD_TEMPLATE) is GENERIC
    with_tools = sdk.chat.completions.create(model="odd", messages=ASK, tools=TOOLS, max_tokens=1)
    described = ToolRequest(GENERIC, TOOLS, None, None).messages(ASK)
    as_text = sdk.chat.completions.create(model="odd", messages=described, max_tokens=1)
    assert described[0]["role"] == "system" and "<tools>" in described[0]["content"]
    assert with_tools.usage.prompt_tokens == as_text.usage.prompt_tokens  # not also the template's own rendering


def test_tool_choice_none_leaves_the_answer_free(server, sdk):
    free = sdk.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    plain = sdk.chat.completions.create(model="hermes", messages=ASK, max_tokens=8, temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"
    assert free.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools are not rendered


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param):
    with server.client() as client:
        reply = client.post("/v1/chat/completions", json={"model": "hermes", "messages": ASK, "max_tokens": 2, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_syntax_is_chosen_from_the_template():
    assert [syntax_for(TOOL_TEMPLATES[f]) for f in ("hermes", "llama3", "mistral")] == [HERMES, LLAMA3, MISTRAL]
    assert syntax_for(None) is GENERIC and syntax_for("{{ messages }}") is GENERIC


@pytest.mark.parametrize("name", ["chatml-function-calling", "functionary-v2"])
def test_stock_tool_chat_formats_are_refused_by_name(tiny_model, name):
    from pflash_plugin.llama import Model

    model = Model(str(tiny_model), verbose=False)
    try:
        with pytest.raises(ValueError, match=f"chat_format '{name}' is llama_cpp's own tool-calling handler"):
            chat_formatter(model, name)
    finally:
        model.close()


# ---- what models write, as the readers parse it ------------------------------------------------
WRITTEN = [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>',
     "Let me look.\n"),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
             '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', ""),
    (LLAMA3, ' {"name": "get_time", "parameters": {"zone": "UTC"}}\n'
             '{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\", \\"days\\": 1}"}', ""),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
              '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}, "id": "a1b2c3d4e"}]', ""),
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
              '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]', "Sure. "),
]


def _reader(syntax, parallel: bool = True) -> ToolCallReader:
    return ToolCallReader(syntax, parallel)


def _accumulated(deltas: list[dict]) -> list[tuple[int, str, dict]]:
    """Tool-call deltas accumulated by index, as OpenAI clients do: (index, name, arguments)."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        indexes = [part["index"] for part in delta.get("tool_calls", [])]
        assert len(set(indexes)) == len(indexes), delta  # one entry per call in a chunk, as OpenAI sends
        for part in delta.get("tool_calls", []):
            assert ("id" in part) == (part["index"] not in calls)  # a call's first delta carries its id
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part["function"].get("name", "")
            call["arguments"] += part["function"].get("arguments", "")
    return [(i, c["name"], json.loads(c["arguments"])) for i, c in sorted(calls.items())]


@pytest.mark.parametrize("syntax, text, content", WRITTEN)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_written_calls_parse_whether_streamed_in_pieces_or_whole(syntax, text, content, step):
    choice = ChatChoice(0, lambda t: b"", False, _reader(syntax))
    deltas = [choice.chunk(text[i:i + step], [], None)["delta"] for i in range(0, len(text), step)]
    last = choice.chunk("", [], "stop")
    assert "".join(d.get("content", "") for d in deltas + [last["delta"]]) == content
    assert last["finish_reason"] == "tool_calls"
    expected = [(0, "get_time", {"zone": "UTC"}), (1, "get_weather", {"city": "Oslo", "days": 1})]
    assert _accumulated(deltas + [last["delta"]]) == expected
    if step == 1:  # the first call's name goes out before its arguments, and both before the answer ends
        first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
        assert first["function"]["name"] == "get_time" and first["function"]["arguments"] in ("", "{") and first["id"]
        assert _accumulated(deltas)[:1] == expected[:1]
    whole = ChatChoice(0, lambda t: b"", False, _reader(syntax))
    whole.add(text, [])
    final = whole.final("stop")
    assert final["finish_reason"] == "tool_calls" and len(final["message"]["tool_calls"]) == 2
    assert final["message"]["content"] == (content or None)


NAMES = frozenset(SCHEMAS)


def _streamed_and_whole(syntax, text: str, finish: str, step: int = 1, names=NAMES, parallel: bool = True):
    """The reply read streamed (in `step`-character pieces) and whole: for each, its content, its
    calls as (name, arguments text) and its finish reason."""
    choice = ChatChoice(0, lambda t: b"", False, ToolCallReader(syntax, parallel, names))
    deltas = [choice.chunk(text[i:i + step], [], None)["delta"] for i in range(0, len(text), step)]
    last = choice.chunk("", [], finish)
    calls: dict[int, list[str]] = {}
    for delta in deltas + [last["delta"]]:
        for part in delta.get("tool_calls", []):
            assert ("id" in part) == (part["index"] not in calls)  # a call's first delta carries its id
            call = calls.setdefault(part["index"], ["", ""])
            call[0] += part["function"].get("name", "")
            call[1] += part["function"].get("arguments", "")
    content = "".join(d.get("content", "") for d in deltas + [last["delta"]])
    streamed = (content, [tuple(calls[i]) for i in sorted(calls)], last["finish_reason"])
    whole = ChatChoice(0, lambda t: b"", False, ToolCallReader(syntax, parallel, names))
    whole.add(text, [])
    final = whole.final(finish)
    message = final["message"]
    whole_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return streamed, (message["content"] or "", whole_calls, final["finish_reason"])


def _parsed(calls: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


TIME_UTC = ("get_time", {"zone": "UTC"})
# (syntax, what the model wrote, the content, the calls) - the same streamed and whole
READ = [
    # complete call objects are the calls, and text after them is ignored
    (LLAMA3, '{"name": "get_time", "parameters": {"zone": "UTC"}} That is the call I would make.', "", [TIME_UTC]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\nDone. {"x": 1}',
     "", [TIME_UTC]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}] and then words', "", [TIME_UTC]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_time", "arguments": "not json"}\n</tool_call>', "", [TIME_UTC]),
    # arguments that are not a JSON object: not a call, in both ways
    (HERMES, 'Hm. <tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>', None, []),
    (LLAMA3, '{"name": "get_time", "parameters": 42}', None, []),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": [1]}]', None, []),
    (LLAMA3, '{"name": "get_time", "parameters": nul}', None, []),
    # null arguments are none: {}
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": null}\n</tool_call>', "", [("get_time", {})]),
    (LLAMA3, '{"name": "get_time", "parameters": null, "id": "x"}', "", [("get_time", {})]),
    # a function that is not a tool, or no arguments: content
    (LLAMA3, '{"name": "Bob", "age": 3}', None, []),
    (LLAMA3, '{"name": "Bob", "parameters": {"age": 3}}', None, []),
    (LLAMA3, '{"name": "get_time"}', None, []),
    (HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', None, []),
    # after content that was not a call, a call still counts
    (MISTRAL, '[1, 2] are numbers. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     "[1, 2] are numbers. ", [TIME_UTC]),
    # the keys in another order
    (LLAMA3, '{"parameters": {"zone": "UTC"}, "name": "get_time"}', "", [TIME_UTC]),
]


@pytest.mark.parametrize("syntax, text, content, calls", READ, ids=[f"read{i}" for i in range(len(READ))])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_and_whole_replies_read_the_same(syntax, text, content, calls, step):
    streamed, whole = _streamed_and_whole(syntax, text, "stop", step)
    assert (streamed[0], _parsed(streamed[1]), streamed[2]) == (whole[0], _parsed(whole[1]), whole[2])
    assert whole[0] == (text if content is None else content)
    assert _parsed(whole[1]) == calls
    assert whole[2] == ("tool_calls" if calls else "stop")


def test_a_call_of_an_unknown_function_streams_no_header():
    """The header waits until the name is checked against the tools."""
    reader = ToolCallReader(LLAMA3, True, NAMES)
    text = '{"name": "Bob", "age": 3}'
    reads = [reader.read(c, None, True) for c in text]
    assert not any(calls for _, calls, _ in reads)
    assert "".join(content for content, _, _ in reads) == text  # content as soon as the name is not a tool's
    assert ToolCallReader(LLAMA3, True, NAMES).read('{"name": "Bob"', None, True)[0] == '{"name": "Bob"'


def test_request_readers_know_the_tools():
    reader = ToolRequest(HERMES, TOOLS, None, None).reader()
    assert reader.names == NAMES and reader.parallel
    assert not ToolRequest(HERMES, TOOLS, None, False).reader().parallel


@pytest.mark.parametrize("syntax, text", [
    (MISTRAL, "[1, 2, 3] and a long answer after it"),
    (LLAMA3, '{"answer": 42} and a long answer after it'),
    (HERMES, "<tool_call> is a tag, and a long answer after it"),
])
def test_an_answer_that_only_starts_like_calls_streams_as_it_comes(syntax, text):
    reader = ToolCallReader(syntax, True, NAMES)
    cut = text.index(" and a long")
    released = "".join(reader.read(c, None, True)[0] for c in text[:cut + 1])
    assert released == text[:cut + 1]  # not held until the answer ends
    rest = "".join(reader.read(c, None, True)[0] for c in text[cut + 1:])
    assert released + rest + reader.read("", "stop", True)[0] == text


CUT = [
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Os'),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_wea'),
    (LLAMA3, '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"ci'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "argum'),
]


@pytest.mark.parametrize("syntax, text", CUT, ids=[f"cut{i}" for i in range(len(CUT))])
@pytest.mark.parametrize("step", [1, 1000])
def test_a_reply_cut_at_max_tokens_keeps_its_complete_calls(syntax, text, step):
    """Its complete calls finish as tool_calls (what an agent loop looks for); streamed, a cut
    call whose header went out already finishes as length."""
    streamed, whole = _streamed_and_whole(syntax, text, "length", step)
    assert whole == ("", [("get_time", '{"zone": "UTC"}')], "tool_calls")
    assert streamed[0] == "" and _parsed(streamed[1][:1]) == [TIME_UTC]
    assert streamed[2] == ("length" if len(streamed[1]) > 1 else "tool_calls")


def test_a_call_cut_short_ends_as_length():
    """The one way streamed and whole differ: the cut call's header and arguments went out as the
    model wrote them (as OpenAI streams a call that max_tokens cut); whole, it is dropped, and
    with no complete call the text is content."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zo'
    streamed, whole = _streamed_and_whole(HERMES, text, "length")
    assert streamed == ("", [("get_time", '{"zo')], "length")
    assert whole == (text, [], "length")
    # cut before the call was known to be one: content, both ways
    streamed, whole = _streamed_and_whole(HERMES, text[:text.index('"arguments')], "length")
    assert streamed == whole == (text[:text.index('"arguments')], [], "length")


@pytest.mark.parametrize("syntax, text", [
    (HERMES, "No tools needed: <tool_call is a tag I know."),
    (LLAMA3, '{"answer": 42} is JSON, not a call'),
    (MISTRAL, "[1, 2] are numbers"),
    (GENERIC, "Plain words <tool_"),
])
def test_text_that_is_not_a_call_is_content(syntax, text):
    reader = _reader(syntax)
    released = "".join(reader.feed(c) for c in text)
    rest, calls = reader.finish()
    assert calls == [] and released + rest == text
    choice = ChatChoice(0, lambda t: b"", False, _reader(syntax))
    deltas = [choice.chunk(c, [], None)["delta"] for c in text] + [choice.chunk("", [], "length")["delta"]]
    assert not any("tool_calls" in d for d in deltas) and "".join(d.get("content", "") for d in deltas) == text


def test_parallel_false_keeps_the_first_written_call():
    reader = _reader(HERMES, parallel=False)
    reader.feed(WRITTEN[0][1])
    _, calls = reader.finish()
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_a_forced_call_on_the_demo_model(demo_model):
    """The demo model (Gemma 3, whose template renders no tools) makes a forced call with a free string."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
    settings = {"model": str(demo_model), "model_alias": "demo", "n_ctx": 1024, "max_concurrency": 1}
    with live_server([settings]) as live:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        reply = sdk.chat.completions.create(model="demo", messages=ASK, tools=[tool], tool_choice="required",
                                            max_tokens=100, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3, MISTRAL, GENERIC])
@pytest.mark.parametrize("parallel", [None, False, True])
def test_every_forced_grammar_is_one_llama_cpp_takes(tiny_model, syntax, parallel):
    from pflash_plugin.llama import Model, check_grammar

    model = Model(str(tiny_model), verbose=False)
    try:
        for forced in (["get_weather"], ["get_weather", "get_time"]):
            grammar = ToolRequest(syntax, TOOLS, forced, parallel).grammar()
            assert grammar is not None and grammar.startswith("root ::=")
            check_grammar(model, grammar)
            if syntax is not MISTRAL:  # whose array's schema bounds the count instead
                assert ("*" in grammar.splitlines()[0]) == (parallel is True)
    finally:
        model.close()


def _defs_tool(name: str, unit: list[str]) -> dict:
    """A tool whose parameters use `$defs` (as pydantic writes them), with a def name another tool shares."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
        "$defs": {"Place": {"type": "object", "properties": {"unit": {"$ref": "#/definitions/Unit"}},
                            "required": ["unit"]}},
        "definitions": {"Unit": {"enum": unit}}}}}


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL])
def test_a_schema_with_defs_and_refs_makes_a_grammar(tiny_model, syntax):
    from pflash_plugin.llama import Model, check_grammar

    tools = [_defs_tool("a", ["km"]), _defs_tool("b", ["mi"])]
    grammars = [ToolRequest(syntax, tools, forced, True).grammar() for forced in (["a"], ["a", "b"])]
    assert '\\"km\\"' in grammars[1] and '\\"mi\\"' in grammars[1]  # each tool keeps its own Unit
    assert '\\"mi\\"' not in grammars[0]
    model = Model(str(tiny_model), verbose=False)
    try:
        for grammar in grammars:
            check_grammar(model, grammar)
    finally:
        model.close()
