"""Every family's tool-call syntax on its real template (tests/data/templates): the ones written in
tags (pflash_plugin/chat/tool_syntaxes.py: Qwen3.5's and Qwen3-Coder's XML, GLM 4.5's pairs, DeepSeek
V3.1's, Kimi K2's, gpt-oss's and Functionary v3.1's markers) and the JSON ones (Hermes on Qwen2.5,
Llama 3.1, Mistral Nemo, Granite 3.3, Command R7B). A named tool_choice makes the server force a call
in the family's own syntax, and a request grammar writes text then calls, or parallel calls: each
comes back as tool_calls (chat), function_call items (Responses) and tool_use blocks (Messages),
plain and streamed. The readers, streamed in any pieces and whole; the forced grammars."""
from __future__ import annotations

import json
import typing
from pathlib import Path

import jsonschema
import pytest
from conftest import live_server

from pflash_plugin.chat.tool_syntaxes import (
    DEEPSEEK_V3_1,
    FUNCTIONARY_V3_1,
    GLM45,
    GPT_OSS,
    KIMI_K2,
    QWEN3_CODER,
    TaggedSyntax,
)
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.server.preparation.tool_requests import ToolRequest
from pflash_plugin.chat.tool_calls import (
    COMMAND_R7B,
    GENERIC,
    GRANITE,
    HERMES,
    LLAMA3,
    MISTRAL,
    SYNTAXES,
    TOOL_SYNTAXES,
    ToolCallReader,
    syntax_for,
)
from pflash_plugin.testing import cached_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"
FAMILIES = {  # alias: (template file, the syntax its markers choose)
    "qwen35": ("Qwen3.5-4B.jinja", QWEN3_CODER),
    "qwen3_coder": ("Qwen3-Coder.jinja", QWEN3_CODER),
    "glm45": ("GLM-4.6.jinja", GLM45),
    "deepseek_v3_1": ("deepseek-ai-DeepSeek-V3.1.jinja", DEEPSEEK_V3_1),
    "kimi_k2": ("Kimi-K2-Instruct.jinja", KIMI_K2),
    "gpt_oss": ("openai-gpt-oss-120b.jinja", GPT_OSS),
    "functionary_v3_1": ("meetkai-functionary-medium-v3.1.jinja", FUNCTIONARY_V3_1),
    "granite": ("ibm-granite-granite-3.3-2B-Instruct.jinja", GRANITE),
    "command_r7b": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", COMMAND_R7B),
    "qwen25": ("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES),
    "llama31": ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3),
    "mistral_nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL),
}
# control tokens in gpt-oss's vocabulary (the test model adds them as such; the server renders them)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer"},
    "note": {"type": "string", "maxLength": 12},
    "metric": {"type": "boolean"},
}, "required": ["city", "days", "note"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# what each family writes: a text, then two calls (the second one's value has a newline and a quote)
TEXT = "Let me look.\n"
CALLS = [("get_weather", {"city": "Paris", "days": 2, "note": "a \"b\"\nc"}), ("get_time", {"zone": "UTC"})]
WRITTEN = {
    QWEN3_CODER: "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                 "</parameter>\n<parameter=note>\na \"b\"\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                 "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
    GLM45: "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
           "<arg_value>2</arg_value>\n<arg_key>note</arg_key>\n<arg_value>a \"b\"\nc</arg_value>\n</tool_call>\n"
           "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",
    DEEPSEEK_V3_1: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", "
                   "\"days\": 2, \"note\": \"a \\\"b\\\"\\nc\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time"
                   "<｜tool▁sep｜>{\"zone\": \"UTC\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    KIMI_K2: "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             "{\"city\": \"Paris\", \"days\": 2, \"note\": \"a \\\"b\\\"\\nc\"}<|tool_call_end|><|tool_call_begin|>"
             "functions.get_time:1<|tool_call_argument_begin|>{\"zone\": \"UTC\"}<|tool_call_end|>"
             "<|tool_calls_section_end|>",
    # one call a turn; what chat/harmony.py passes on of a call's message (its header whole)
    GPT_OSS: "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             "{\"city\": \"Paris\", \"days\": 2, \"note\": \"a \\\"b\\\"\\nc\"}",
    FUNCTIONARY_V3_1: "<function=get_weather>{\"city\": \"Paris\", \"days\": 2, \"note\": \"a \\\"b\\\"\\nc\"}"
                      "</function>\n<function=get_time>{\"zone\": \"UTC\"}</function>",
    GRANITE: "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2, "
             "\"note\": \"a \\\"b\\\"\\nc\"}}, {\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}]",
    COMMAND_R7B: "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": "
                 "{\"city\": \"Paris\", \"days\": 2, \"note\": \"a \\\"b\\\"\\nc\"}},\n    {\"tool_call_id\": \"1\", "
                 "\"tool_name\": \"get_time\", \"parameters\": {\"zone\": \"UTC\"}}\n]<|END_ACTION|>",
    HERMES: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2, "
            "\"note\": \"a \\\"b\\\"\\nc\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
            "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>",
    LLAMA3: "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 2, "
            "\"note\": \"a \\\"b\\\"\\nc\"}}; {\"name\": \"get_time\", \"parameters\": {\"zone\": \"UTC\"}}",
    MISTRAL: "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2, "
             "\"note\": \"a \\\"b\\\"\\nc\"}}, {\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}]",
}
ONE_CALL = {s for s in WRITTEN if getattr(s, "one_call", False)}
EXPECTED = {syntax: CALLS[:1] if syntax in ONE_CALL else CALLS for syntax in WRITTEN}
SYNTAX_IDS = [s.name for s in WRITTEN]
FORCED_HEAD = {  # how a forced call of get_weather starts, in each syntax
    QWEN3_CODER: "<tool_call>\n<function=get_weather>\n<parameter=city>\n",
    GLM45: "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>",
    DEEPSEEK_V3_1: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{",
    KIMI_K2: "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:",
    GPT_OSS: "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{",
    FUNCTIONARY_V3_1: "<function=get_weather>{",
    GRANITE: "<|tool_call|>[{",
    COMMAND_R7B: "<|START_ACTION|>[{\"tool_name\"",
    HERMES: "<tool_call>\n{\"name\"",
    LLAMA3: "{\"name\"",
    MISTRAL: "[TOOL_CALLS][{\"name\"",
}
# the text before the calls (Llama 3's calls are the whole message)
BEFORE = {syntax: "" if syntax is LLAMA3 else TEXT for syntax in WRITTEN}


def _loads(text: str) -> object:
    """Arguments as JSON; a call cut short's as the text that went out."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _read(syntax, text: str, step: int, finish: str = "stop", parallel: bool = True):
    """`text` read in `step`-character pieces: (content, [(name, arguments)], finish), and whole."""
    reader = ToolCallReader(syntax, parallel, SCHEMAS, SCHEMAS)
    content, calls, reason = "", {}, None
    for i in range(0, len(text) + 1, step):
        piece, deltas, reason = reader.read(text[i:i + step], finish if i + step > len(text) else None, True)
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], ["", ""])
            call[0] += delta["function"].get("name", "")
            call[1] += delta["function"]["arguments"]
    whole, found, whole_reason = ToolCallReader(syntax, parallel, SCHEMAS, SCHEMAS).read(text, finish, False)
    streamed = (content, [(n, _loads(a)) for n, a in calls.values()], reason)
    return streamed, (whole, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found],
                      whole_reason)


# ---- the readers --------------------------------------------------------------------------------
@pytest.mark.parametrize("syntax", WRITTEN, ids=SYNTAX_IDS)
@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_text_then_calls_read_alike_streamed_in_any_pieces_and_whole(syntax, step):
    streamed, whole = _read(syntax, BEFORE[syntax] + WRITTEN[syntax], step)
    assert streamed == whole == (BEFORE[syntax], EXPECTED[syntax], "tool_calls")


@pytest.mark.parametrize("syntax", WRITTEN, ids=SYNTAX_IDS)
def test_llama_cpps_examples_read(syntax):
    """test-chat.cpp's examples of each format (special_function, arg1: 1)."""
    example = {
        QWEN3_CODER: "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
                     "</tool_call>",
        GLM45: "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        DEEPSEEK_V3_1: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>special_function<｜tool▁sep｜>{\"arg1\": 1}"
                       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        KIMI_K2: "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
                 "<|tool_call_argument_begin|>{\"arg1\": 1}<|tool_call_end|><|tool_calls_section_end|>",
        GPT_OSS: " to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{\"arg1\": 1}",
        FUNCTIONARY_V3_1: "<function=special_function>{\"arg1\": 1}</function>",
        GRANITE: "<|tool_call|>[{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}}]",
        COMMAND_R7B: "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", "
                     "\"parameters\": {\"arg1\": 1}}\n]<|END_ACTION|>",
        HERMES: "<tool_call>\n{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}}\n</tool_call>",
        LLAMA3: "{\"name\": \"special_function\", \"parameters\": {\"arg1\": 1}}",
        MISTRAL: "[TOOL_CALLS][{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}, \"id\": \"123456789\"}]",
    }[syntax]
    schema = {"special_function": {"type": "object", "properties": {"arg1": {"type": "integer"}}}}
    content, calls, finish = ToolCallReader(syntax, True, schema, schema).read(example, "stop", False)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("special_function", '{"arg1": 1}')]


@pytest.mark.parametrize("syntax, text", [
    (GLM45, "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>"),  # GLM 4.7
    (QWEN3_CODER, "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>"),  # no <tool_call>
    (DEEPSEEK_V3_1, "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"UTC\"}<｜tool▁call▁end｜>"),
    (KIMI_K2, "<|tool_call_begin|>functions.get_time:3<|tool_call_argument_begin|>{\"zone\": \"UTC\"}"
              "<|tool_call_end|>"),
])
@pytest.mark.parametrize("step", [1, 10_000])
def test_the_families_variants_read(syntax, text, step):
    """GLM 4.7 without newlines, and calls without their section's or block's opening marker."""
    streamed, whole = _read(syntax, text, step)
    assert streamed == whole == ("", [("get_time", {"zone": "UTC"})], "tool_calls")


def test_pair_values_are_typed_by_the_schema():
    """A string parameter's value is its text (even "2" or "true"); others are JSON, or their text."""
    schema = {"f": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "number"}, "o": {"type": "object"}, "a": {"type": "array"},
        "b": {"type": "boolean"}, "e": {"enum": ["x", "y"]}, "u": {"type": ["integer", "string"]}}}}
    values = {"s": "2", "n": "2.5", "o": '{"k": [1]}', "a": "[1, 2]", "b": "true", "e": "x", "u": "abc",
              "free": "[3]"}
    text = "<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()) \
        + "</function>\n</tool_call>"
    _, calls, _ = ToolCallReader(QWEN3_CODER, True, schema, schema).read(text, "stop", False)
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "s": "2", "n": 2.5, "o": {"k": [1]}, "a": [1, 2], "b": True, "e": "x", "u": "abc", "free": [3]}


@pytest.mark.parametrize("syntax, text", [
    (QWEN3_CODER, "Use <tool_call> tags to call a tool."),
    (QWEN3_CODER, "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),  # not one of the tools
    (GLM45, "<tool_call>delete_all\n</tool_call> is not a tool"),
    (DEEPSEEK_V3_1, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"),
    (KIMI_K2, "<|tool_calls_section_begin|> and words"),
    (GPT_OSS, "Hello <|channel|> there"),
    (FUNCTIONARY_V3_1, "<function=rm_rf>{}</function>"),
    (GRANITE, "<|tool_call|> is how I call tools"),
])
@pytest.mark.parametrize("step", [1, 10_000])
def test_text_that_is_not_calls_is_content(syntax, text, step):
    streamed, whole = _read(syntax, text, step)
    assert streamed == whole == (text, [], "stop")


@pytest.mark.parametrize("syntax", [s for s in WRITTEN if s not in ONE_CALL], ids=lambda s: s.name)
def test_a_reply_cut_at_max_tokens_keeps_its_complete_calls(syntax):
    text = WRITTEN[syntax]
    cut = text[:text.index("UTC")]  # in the second call's arguments
    streamed, whole = _read(syntax, cut, 3, finish="length")
    assert whole == ("", CALLS[:1], "tool_calls")
    assert streamed[1][:1] == CALLS[:1] and streamed[2] == "length"  # the cut call's header went out


@pytest.mark.parametrize("syntax", WRITTEN, ids=SYNTAX_IDS)
def test_parallel_false_keeps_the_first_call(syntax):
    streamed, whole = _read(syntax, WRITTEN[syntax], 4, parallel=False)
    assert streamed[1] == whole[1] == CALLS[:1]


LONG_HEADS = {  # a call whose one value goes on and on
    QWEN3_CODER: "<tool_call>\n<function=get_time>\n<parameter=zone>\n",
    DEEPSEEK_V3_1: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"",
    HERMES: "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"",
}


@pytest.mark.parametrize("syntax", LONG_HEADS, ids=lambda s: s.name)
def test_reading_holds_a_bounded_text_whatever_the_calls_length(syntax):
    """O(1) per token: streamed, a 200,000-character value is not held by the reader, the scanner
    keeps only what it has not read (a close marker's search resumes near the end), and what
    went out adds up to the value."""
    reader = ToolCallReader(syntax, True, SCHEMAS, SCHEMAS)
    sent = "".join(d["function"]["arguments"] for d in reader.read(LONG_HEADS[syntax], None, True)[1])
    for _ in range(20_000):
        sent += "".join(d["function"]["arguments"] for d in reader.read("abcdefghi ", None, True)[1])
        assert reader.pending == "" and reader.scanner is not None and len(reader.scanner.text) < 5_000
        if isinstance(syntax, TaggedSyntax):
            assert len(reader.scanner.text) - max(reader.scanner.seek, reader.scanner.pos) < 32
    if syntax is QWEN3_CODER:  # a pair goes out once its value ends
        assert sent == "" and "".join(reader.scanner.value).count("abcdefghi ") >= 19_990
    else:
        assert sent.count("abcdefghi ") >= 19_990


def test_the_syntax_is_chosen_from_the_templates_markers_or_the_flag():
    for template, syntax in FAMILIES.values():
        assert syntax_for((TEMPLATES / template).read_text()) is syntax
    assert syntax_for((TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text()) is GENERIC  # R1's fenced JSON
    assert syntax_for((TEMPLATES / "Qwen3.5-4B.jinja").read_text(), "hermes") is HERMES
    assert all(syntax_for(None, name) is syntax for name, syntax in SYNTAXES.items())
    setting = ModelSettings.model_fields["tool_syntax"]
    assert set(typing.get_args(setting.annotation)) == set(TOOL_SYNTAXES) and setting.default == "auto"


@pytest.mark.parametrize("syntax", WRITTEN, ids=SYNTAX_IDS)
@pytest.mark.parametrize("parallel", [False, True])
def test_every_forced_grammar_is_one_llama_cpp_takes(tiny_model, syntax, parallel):
    from pflash_plugin.llama import Model, check_grammar

    model = Model(str(tiny_model), verbose=False)
    try:
        for forced in (["get_weather"], ["get_weather", "get_time"]):
            grammar = ToolRequest(syntax, TOOLS, forced, parallel).grammar()
            assert grammar is not None and grammar.startswith("root ::=")
            check_grammar(model, grammar)
            if isinstance(syntax, TaggedSyntax):  # (Granite's array: its schema bounds the count)
                assert ("*" in grammar.splitlines()[0]) == (parallel and not syntax.one_call)
    finally:
        model.close()


# ---- the APIs, on tiny models with the families' templates ------------------------------------
@pytest.fixture(scope="module")
def server():
    def model(alias: str, template: str, **kw) -> dict:
        tokens = HARMONY_TOKENS if alias == "gpt_oss" else ()
        path = cached_tiny_llama(chat_template=(TEMPLATES / template).read_text(), control_tokens=tokens)
        return {"model": str(path), "model_alias": alias, "n_ctx": 4096, "max_concurrency": 2, "n_threads": 1,
                "n_threads_batch": 1, **kw}

    models = [model(alias, template) for alias, (template, _) in FAMILIES.items()]
    with live_server([*models, model("qwen35_as_hermes", "Qwen3.5-4B.jinja", tool_syntax="hermes")]) as live:
        yield live


def _sse(response) -> list[dict]:
    assert response.status_code == 200, response.read()
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def _post(client, path: str, body: dict, stream: bool) -> dict | list[dict]:
    if not stream:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        return _sse(response)


def _chat_calls(client, body: dict, stream: bool) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish_reason) of a chat completion, plain or streamed."""
    reply = _post(client, "/v1/chat/completions", body, stream)
    if isinstance(reply, dict):
        choice = reply["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message.get("tool_calls") or []]
        return message["content"] or "", calls, choice["finish_reason"]
    content, parts, finish = "", {}, ""
    for chunk in reply:
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                part = parts.setdefault(delta["index"], ["", ""])
                part[0] += delta["function"].get("name") or ""
                part[1] += delta["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [(n, json.loads(a)) for n, a in parts.values()], finish


def _responses_calls(client, body: dict, stream: bool) -> tuple[str, list[tuple[str, dict]]]:
    """(text, function calls) of a Responses answer; streamed, the calls' argument deltas must
    add up to the completed response's items."""
    reply = _post(client, "/v1/responses", body, stream)
    if isinstance(reply, list):
        deltas = "".join(e["delta"] for e in reply if e["type"] == "response.function_call_arguments.delta")
        reply = next(e["response"] for e in reply if e["type"] == "response.completed")
        assert deltas == "".join(i["arguments"] for i in reply["output"] if i["type"] == "function_call")
    text = "".join(p["text"] for i in reply["output"] if i["type"] == "message" for p in i["content"])
    calls = [(i["name"], json.loads(i["arguments"])) for i in reply["output"] if i["type"] == "function_call"]
    return text, calls


def _messages_calls(client, body: dict, stream: bool) -> tuple[str, list[tuple[str, dict]], str]:
    """(text, tool_use blocks, stop_reason) of an Anthropic Messages answer, plain or streamed."""
    reply = _post(client, "/v1/messages", body, stream)
    if isinstance(reply, dict):
        text = "".join(b["text"] for b in reply["content"] if b["type"] == "text")
        uses = [(b["name"], b["input"]) for b in reply["content"] if b["type"] == "tool_use"]
        return text, uses, reply["stop_reason"]
    blocks: dict[int, dict] = {}
    stop = ""
    for event in reply:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = {**event["content_block"], "json": ""}
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            block["text" if delta["type"] == "text_delta" else "json"] = \
                block.get("text", "") + delta["text"] if delta["type"] == "text_delta" else \
                block["json"] + delta.get("partial_json", "")
        elif event["type"] == "message_delta":
            stop = event["delta"]["stop_reason"]
    ordered = [blocks[i] for i in sorted(blocks)]
    text = "".join(b.get("text", "") for b in ordered if b["type"] == "text")
    return text, [(b["name"], json.loads(b["json"])) for b in ordered if b["type"] == "tool_use"], stop


def _valid(calls: list[tuple[str, dict]]) -> list[str]:
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return [name for name, _ in calls]


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_named_tool_choice_is_forced_in_the_familys_syntax_on_every_api(server, family, stream):
    """With the templates' thinking on (Qwen3.5's prompt opens the block: the forced grammar closes
    it first, and the call is read outside it)."""
    common = {"model": family, "temperature": 0}
    chat = {**common, "messages": ASK, "tools": TOOLS, "max_tokens": 400,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with server.client() as client:
        content, calls, finish = _chat_calls(client, chat, stream)
        assert (content, _valid(calls), finish) == ("", ["get_weather"], "tool_calls")
        # what the model wrote (its tokens' text): the call in the family's own syntax
        tokens = client.post("/v1/chat/completions", json={**chat, "logprobs": True}).json()
        written = bytes(b for t in tokens["choices"][0]["logprobs"]["content"] for b in t["bytes"]).decode()
        assert FORCED_HEAD[FAMILIES[family][1]] in written[:80]
        text, calls = _responses_calls(client, {**common, "input": ASK, "tools": RESPONSES_TOOLS,
                                                "max_output_tokens": 400,
                                                "tool_choice": {"type": "function", "name": "get_weather"}}, stream)
        assert (text, _valid(calls)) == ("", ["get_weather"])
        text, calls, stop = _messages_calls(client, {**common, "messages": ASK, "tools": ANTHROPIC_TOOLS,
                                                     "max_tokens": 400,
                                                     "tool_choice": {"type": "tool", "name": "get_weather"}}, stream)
        assert (text, _valid(calls), stop) == ("", ["get_weather"], "tool_use")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_text_then_parallel_calls_come_back_on_every_api(server, family, stream):
    """A request grammar writes the family's real shape: a text, then two calls."""
    syntax = FAMILIES[family][1]
    before = BEFORE[syntax]
    # gpt-oss: the text on the final channel, then the call's message
    text = f"<|channel|>final<|message|>{TEXT}<|end|>" if syntax is GPT_OSS else before
    grammar = "root ::= " + json.dumps(text + WRITTEN[syntax], ensure_ascii=False)
    common = {"model": family, "temperature": 0, "grammar": grammar}  # thinking off: the answer is content
    expected = EXPECTED[syntax]
    with server.client() as client:
        content, calls, finish = _chat_calls(client, {**common, "messages": ASK, "tools": TOOLS, "max_tokens": 400,
                                                      "reasoning_effort": "none"}, stream)
        assert (content, calls, finish) == (before, expected, "tool_calls")
        text, calls = _responses_calls(client, {**common, "input": ASK, "tools": RESPONSES_TOOLS,
                                                "max_output_tokens": 400, "reasoning": {"effort": "none"}}, stream)
        assert (text, calls) == (before, expected)
        text, calls, stop = _messages_calls(client, {**common, "messages": ASK, "tools": ANTHROPIC_TOOLS,
                                                     "max_tokens": 400, "thinking": {"type": "disabled"}}, stream)
        assert (text.strip(), calls, stop) == (before.strip(), expected, "tool_use")


def test_the_tool_syntax_setting_overrides_the_templates_markers(server):
    """--tool_syntax hermes on Qwen3.5's template: the forced call is Hermes JSON, and read back."""
    chat = {"model": "qwen35_as_hermes", "messages": ASK, "tools": TOOLS, "max_tokens": 400, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "logprobs": True}
    with server.client() as client:
        reply = client.post("/v1/chat/completions", json=chat).json()
    choice = reply["choices"][0]
    written = bytes(b for t in choice["logprobs"]["content"] for b in t["bytes"]).decode()
    assert written.startswith('</think>\n\n<tool_call>\n{"name"') and "<function=" not in written
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_qwen35_thinks_then_calls(server, stream):
    """Qwen3.5 with its thinking on (the prompt opens the block): the thinking comes back as
    reasoning, the call after it as the call (chat), and as thinking then tool_use blocks (Messages)."""
    thought = "The user wants the weather."
    grammar = "root ::= " + json.dumps(f"{thought}\n</think>\n\n{WRITTEN[QWEN3_CODER]}")
    body = {"model": "qwen35", "temperature": 0, "grammar": grammar, "messages": ASK, "max_tokens": 400}
    with server.client() as client:
        reply = _post(client, "/v1/chat/completions", {**body, "tools": TOOLS}, stream)
        if isinstance(reply, dict):
            message = reply["choices"][0]["message"]
            reasoning = message["reasoning_content"]
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        else:
            deltas = [c["choices"][0]["delta"] for c in reply if c["choices"]]
            reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
            calls = _chat_calls(client, {**body, "tools": TOOLS}, stream)[1]
        assert (reasoning, calls) == (thought, CALLS)
        answer = _post(client, "/v1/messages", {**body, "tools": ANTHROPIC_TOOLS}, False)
    assert isinstance(answer, dict)
    assert [b["type"] for b in answer["content"]] == ["thinking", "tool_use", "tool_use"]
    assert answer["content"][0]["thinking"] == thought and answer["stop_reason"] == "tool_use"
