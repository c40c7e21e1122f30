"""Thinking split from the answer (chat/reasoning.py) on real reasoning templates (tests/data/templates:
Qwen3.5's and llama.cpp's DeepSeek R1), a tiny model's answers forced by a grammar into the shape those
models write: reasoning_content on chat, reasoning items on Responses, thinking blocks on Messages,
plain and streamed; the per-request switches of the templates' thinking."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import live_server

from pflash_plugin.chat.deltas import ReasoningDelta, TextDelta, merged
from pflash_plugin.chat.harmony import HarmonyReader
from pflash_plugin.chat.reasoning import (
    HARMONY,
    MAGISTRAL,
    THINK,
    ReasoningReader,
    opens_in_prompt,
    requested_tags,
    think_tags,
)
from pflash_plugin.llama import Model
from pflash_plugin.testing import CHATML_TEMPLATE, cached_tiny_llama
from pflash_plugin.testing.tool_templates import TOOL_TEMPLATES

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN35 = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
DEEPSEEK_R1 = (TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text()
MAGISTRAL_TEMPLATE = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()
MARKERS = ("[THINK]", "[/THINK]")  # control tokens in Mistral's vocabularies
THOUGHT, ANSWER = "I should answer briefly.", "Paris is the capital."
WRITTEN = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # the answer as Qwen3 writes it
AFTER_OPEN = f"{THOUGHT}\n</think>\n\n{ANSWER}"  # as Qwen3.5 and R1 write it after the prompt's <think>\n
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _gbnf(text: str) -> str:
    return "root ::= " + json.dumps(text)  # a JSON string is a GBNF literal (\n, \", \\ escapes)


def _read(chunks: list[str], inside: bool, tags=THINK) -> tuple[list, int]:
    reader = ReasoningReader(tags, inside)
    deltas = [d for chunk in chunks for d in reader.feed(chunk, 1)] + reader.finish()
    return merged(deltas), reader.tokens


# ---- the reader ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,inside", [(WRITTEN, False), (AFTER_OPEN, True), (WRITTEN, True)])
def test_the_reader_splits_thinking_alike_in_any_pieces(text, inside):
    expected = [ReasoningDelta(THOUGHT), TextDelta(ANSWER)]
    assert _read([text], inside)[0] == expected
    for step in (1, 2, 3, 5, 7):
        assert _read([text[i:i + step] for i in range(0, len(text), step)], inside)[0] == expected
    # tokens: the pieces up to and with the close marker's last character
    assert _read(list(text), inside)[1] == text.index("</think>") + len("</think>")


def test_the_reader_holds_back_no_more_than_a_marker_whatever_the_length():
    """O(1) per token: a long thinking is released as it comes, never re-read (what is held back
    at any time is shorter than the close marker, or a run of whitespace)."""
    reader = ReasoningReader(THINK, inside=True)
    released = 0
    for i in range(20_000):
        released += sum(len(d.text) for d in reader.feed(f"word{i} </th" if i % 7 == 0 else f"w{i} ", 1))
        assert len(reader.held) < len("</think>") and len(reader.space) <= 1
    assert released > 100_000 and reader.tokens == 20_000


def test_text_without_a_block_is_content_and_an_unclosed_block_is_reasoning():
    assert _read(list("Hello <think> there"), False) == ([TextDelta("Hello <think> there")], 0)
    assert _read(list("  <thin"), False)[0] == [TextDelta("  <thin")]  # a marker never finished
    assert _read(list("<think>cut short </thi"), False)[0] == [ReasoningDelta("cut short </thi")]
    assert _read(list("all thought"), True) == ([ReasoningDelta("all thought")], 11)
    assert _read(list("[THINK]Hm.[/THINK]Yes."), False, MAGISTRAL)[0] == [ReasoningDelta("Hm."), TextDelta("Yes.")]


def test_the_families_markers_are_read_from_their_templates():
    assert think_tags(QWEN35) is THINK and think_tags(DEEPSEEK_R1) is THINK
    glm = "{{ '\\n<think></think>' if not enable_thinking }}{{ content.split('</think>')[-1] }}"
    kimi = "<think>{{rc}}</think>{{render_content(message)}}"
    magistral = "{{ '[THINK]' + block['thinking'] + '[/THINK]' }}"
    assert think_tags(glm) is THINK and think_tags(kimi) is THINK and think_tags(magistral) is MAGISTRAL
    assert think_tags(CHATML_TEMPLATE) is None and requested_tags(None, "deepseek") is THINK
    assert requested_tags(THINK, "none") is None and requested_tags(MAGISTRAL, "deepseek") is MAGISTRAL
    assert opens_in_prompt(THINK, "assistant\n<think>\n") and not opens_in_prompt(THINK, "<think>\n\n</think>\n\n")


def test_the_tiny_vocabulary_writes_think_tags_as_text():
    """<think> is plain text here (in real Qwen vocabularies a user-defined token, which llama.cpp
    also renders): the server's detokenizer, which drops control tokens, keeps it."""
    model = Model(cached_tiny_llama(chat_template=QWEN35))
    tokens = model.tokenize(WRITTEN, add_special=False, parse_special=True)
    assert len(tokens) > 10 and model.detokenize(tokens) == WRITTEN
    assert b"".join(model.piece(t) for t in tokens[:3]) == b"<think>"


# ---- the APIs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    def model(alias: str, template: str, control_tokens: tuple[str, ...] = (), **kw) -> dict:
        path = cached_tiny_llama(chat_template=template, control_tokens=control_tokens)
        return {"model": str(path), "model_alias": alias, "n_ctx": 2048, "max_concurrency": 2, "n_threads": 1,
                "n_threads_batch": 1, **kw}

    with live_server([model("qwen35", QWEN35), model("r1", DEEPSEEK_R1),
                      model("raw", QWEN35, reasoning_format="none"),
                      model("hermes", TOOL_TEMPLATES["hermes"], reasoning_format="deepseek"),
                      model("magistral", MAGISTRAL_TEMPLATE, control_tokens=MARKERS),
                      model("gpt-oss", GPT_OSS, control_tokens=HARMONY_TOKENS),
                      model("chatml", CHATML_TEMPLATE)]) as live:
        yield live


def _sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def _chat(client, model: str, forced: str, stream: bool, **kw) -> dict | list[dict]:
    body = {"model": model, "messages": ASK, "max_tokens": 60, "grammar": _gbnf(forced), "stream": stream,
            "temperature": 0, **kw}  # greedy: the streamed answer is the same tokens
    if not stream:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        return _sse(response)


@pytest.mark.parametrize("model", ["qwen35", "r1"])
@pytest.mark.parametrize("forced", [AFTER_OPEN, WRITTEN])
def test_chat_gives_the_thinking_as_reasoning_content(server, model, forced):
    with server.client() as client:
        body = _chat(client, model, forced, stream=False)
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
        usage = body["usage"]
        assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
        chunks = _chat(client, model, forced, stream=True, stream_options={"include_usage": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    assert chunks[-1]["usage"]["completion_tokens_details"] == usage["completion_tokens_details"]


def test_reasoning_format_none_leaves_the_thinking_in_the_content(server):
    with server.client() as client:
        message = _chat(client, "raw", WRITTEN, stream=False)["choices"][0]["message"]
    assert message["content"] == WRITTEN and message["reasoning_content"] is None


def test_responses_give_a_reasoning_item_before_the_message(server):
    body = {"model": "qwen35", "input": ASK[0]["content"], "max_output_tokens": 60}
    with server.client() as client:
        plain = _responses(client, body, stream=False)
        events = _responses(client, body, stream=True)
    reasoning, message = plain["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert message["content"][0]["text"] == ANSWER and plain["output_text"] == ANSWER
    assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert next(e for e in events if e["type"] == "response.reasoning_text.done")["text"] == THOUGHT
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    done = events[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == reasoning["content"]


def test_the_openai_sdk_reads_the_reasoning_item(server):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {"grammar": _gbnf(AFTER_OPEN)}
    reply = sdk.responses.create(model="qwen35", input=ASK[0]["content"], max_output_tokens=60, extra_body=extra)
    assert reply.output[0].type == "reasoning" and reply.output[0].content[0].text == THOUGHT
    assert reply.output_text == ANSWER and reply.usage.output_tokens_details.reasoning_tokens > 0
    with sdk.responses.stream(model="qwen35", input=ASK[0]["content"], max_output_tokens=60,
                              extra_body=extra) as stream:
        thought = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert thought == THOUGHT and final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    chat = sdk.chat.completions.create(model="qwen35", messages=ASK, max_tokens=60, extra_body=extra)
    assert chat.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    assert chat.usage.completion_tokens_details.reasoning_tokens > 0


def _responses(client, body: dict, stream: bool) -> dict | list[dict]:
    sent = {**body, "stream": stream, "grammar": _gbnf(AFTER_OPEN)}
    if not stream:
        response = client.post("/v1/responses", json=sent)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", "/v1/responses", json=sent) as response:
        assert response.status_code == 200
        return _sse(response)


def _messages(client, stream: bool, **kw) -> dict | list[dict]:
    body = {"model": "r1", "max_tokens": 60, "messages": ASK, "grammar": _gbnf(AFTER_OPEN), "stream": stream, **kw}
    if not stream:
        response = client.post("/v1/messages", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        return _sse(response)


def test_messages_give_a_thinking_block_before_the_text(server):
    with server.client() as client:
        plain = _messages(client, stream=False)
        events = _messages(client, stream=True)
    assert plain["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                {"type": "text", "text": ANSWER}]
    assert plain["stop_reason"] == "end_turn"
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == THOUGHT
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == ANSWER
    signature = next(i for i, d in enumerate(deltas) if d["type"] == "signature_delta")
    assert all(d["type"] == "text_delta" for d in deltas[signature + 1:])  # the thinking block closed first


def test_the_anthropic_sdk_reads_the_thinking_block(server):
    anthropic = pytest.importorskip("anthropic")
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = sdk.messages.create(model="r1", max_tokens=60, messages=ASK, extra_body={"grammar": _gbnf(AFTER_OPEN)})
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THOUGHT and message.content[1].text == ANSWER
    with sdk.messages.stream(model="r1", max_tokens=60, messages=ASK,
                             extra_body={"grammar": _gbnf(AFTER_OPEN)}) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER


# ---- per-request switches -----------------------------------------------------------------------
def _prompt_tokens(client, **kw) -> int:
    body = {"model": "qwen35", "messages": ASK, "max_tokens": 1, **kw}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_chat_template_kwargs_and_reasoning_effort_switch_the_templates_thinking(server):
    with server.client() as client:
        on = _prompt_tokens(client)
        off = _prompt_tokens(client, chat_template_kwargs={"enable_thinking": False})
        assert off > on  # the generation prompt closes the block: <think>\n\n</think>\n\n
        assert _prompt_tokens(client, chat_template_kwargs={"enable_thinking": True}) == on
        assert _prompt_tokens(client, reasoning_effort="none") == off
        assert _prompt_tokens(client, reasoning_effort="high") == on
        # the request's own kwargs win over what reasoning_effort sets
        assert _prompt_tokens(client, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == on
        refused = client.post("/v1/chat/completions", json={"model": "qwen35", "messages": ASK,
                                                            "chat_template_kwargs": {"messages": []}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
        count = {"model": "qwen35", "messages": ASK}
        anthropic_on = client.post("/v1/messages/count_tokens", json=count).json()["input_tokens"]
        anthropic_off = client.post("/v1/messages/count_tokens",
                                    json={**count, "thinking": {"type": "disabled"}}).json()["input_tokens"]
        assert (anthropic_on, anthropic_off) == (on, off)
        responses_off = client.post("/v1/responses", json={"model": "qwen35", "input": ASK[0]["content"],
                                                           "max_output_tokens": 1, "reasoning": {"effort": "none"}})
        assert responses_off.json()["usage"]["input_tokens"] == off


def test_with_thinking_off_the_answer_is_content(server):
    with server.client() as client:
        body = _chat(client, "qwen35", ANSWER, stream=False, chat_template_kwargs={"enable_thinking": False})
    message = body["choices"][0]["message"]
    assert message["content"] == ANSWER and message["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_an_earlier_turns_reasoning_goes_back_to_the_template(server):
    """Qwen3.5 renders the thinking of the turns after the last user message (a tool loop): the
    thinking sent back as reasoning_content (chat), a reasoning item (Responses) or a thinking block
    (Messages) is in the prompt."""
    with server.client() as client:
        def tokens(thought: str | None) -> tuple[int, int, int]:
            turn = {"role": "assistant", "content": "Let me see."}
            chat = _prompt_tokens(client, messages=[*ASK, {**turn, "reasoning_content": thought} if thought else turn,
                                                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
            thinking = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
            messages = [*ASK, {"role": "assistant", "content": [*thinking, {"type": "text", "text": "Let me see."}]}]
            anthropic = client.post("/v1/messages/count_tokens", json={"model": "qwen35", "messages": messages})
            reasoning = [{"type": "reasoning", "id": "rs_1", "summary": [],
                          "content": [{"type": "reasoning_text", "text": thought}]}] if thought else []
            items = [*ASK, *reasoning, {"type": "message", "role": "assistant", "content": "Let me see."}]
            responses = client.post("/v1/responses", json={"model": "qwen35", "input": items, "max_output_tokens": 1})
            return chat, anthropic.json()["input_tokens"], responses.json()["usage"]["input_tokens"]

        without, with_thought = tokens(None), tokens("The user asks about the weather in Paris.")
    assert all(b > a for a, b in zip(without, with_thought)), (without, with_thought)


# ---- thinking, then a tool call -----------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAN = "I will write <tool_call> for the weather."  # a marker inside the thinking is thinking
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_only_the_answer_after_the_thinking_is_read_for_tool_calls(server, stream):
    """--reasoning_format deepseek on a Hermes template (no thinking markers of its own)."""
    forced = f"<think>\n{PLAN}\n</think>\n\n{CALL}"
    with server.client() as client:
        got = _chat(client, "hermes", forced, stream, tools=WEATHER, max_tokens=200)
        anthropic = client.post("/v1/messages", json={
            "model": "hermes", "max_tokens": 200, "messages": ASK, "grammar": _gbnf(forced), "stream": False,
            "tools": [{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}]}).json()
    if stream:
        deltas = [c["choices"][0]["delta"] for c in got if c["choices"]]
        thought = "".join(d.get("reasoning_content") or "" for d in deltas)
        calls = [call for d in deltas for call in d.get("tool_calls") or []]
        name, arguments = calls[0]["function"]["name"], "".join(c["function"]["arguments"] for c in calls)
        finish = got[-1]["choices"][0]["finish_reason"]
    else:
        message = got["choices"][0]["message"]
        thought, (call,) = message["reasoning_content"], message["tool_calls"]
        name, arguments, finish = call["function"]["name"], call["function"]["arguments"], \
            got["choices"][0]["finish_reason"]
    assert (thought, name, json.loads(arguments), finish) == (PLAN, "get_weather", {"city": "Paris"}, "tool_calls")
    assert [b["type"] for b in anthropic["content"]] == ["thinking", "tool_use"]
    assert anthropic["content"][0]["thinking"] == PLAN and anthropic["stop_reason"] == "tool_use"


# ---- markers that are control tokens ------------------------------------------------------------
def test_control_token_markers_are_read_too(server):
    """Magistral's [THINK] and [/THINK] are control tokens, whose text the detokenizer drops: the
    server has the model write those of its family's markers (llama-server's preserved tokens).
    A logit bias makes the model pick the control tokens where the grammar allows the markers."""
    model = Model(cached_tiny_llama(chat_template=MAGISTRAL_TEMPLATE, control_tokens=MARKERS))
    ids = [model.tokenize(m, add_special=False, parse_special=True) for m in MARKERS]
    assert all(len(one) == 1 for one in ids) and model.piece(ids[0][0]) == b""  # dropped, unless rendered
    bias = {str(one[0]): 100 for one in ids}
    forced = f"[THINK]{THOUGHT}[/THINK]{ANSWER}"
    with server.client() as client:
        for stream in (False, True):
            got = _chat(client, "magistral", forced, stream, logit_bias=bias, max_tokens=120, logprobs=not stream)
            if stream:
                deltas = [c["choices"][0]["delta"] for c in got if c["choices"]]
                split = tuple("".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content"))
            else:
                message = got["choices"][0]["message"]
                split = (message["reasoning_content"], message["content"])
                written = [entry["token"] for entry in got["choices"][0]["logprobs"]["content"]]
                assert written[0] == "[THINK]" and "[/THINK]" in written  # the control tokens, each whole
                usage = got["usage"]
                assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
            assert split == (THOUGHT, ANSWER)


# ---- gpt-oss's harmony channels -----------------------------------------------------------------
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
CHANNELS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"


def test_harmony_channels_split_alike_in_any_pieces():
    for step in (1, 2, 3, 5, len(CHANNELS)):
        reader = HarmonyReader()
        deltas = [d for i in range(0, len(CHANNELS), step) for d in reader.feed(CHANNELS[i:i + step], 1)]
        assert merged(deltas + reader.finish()) == [ReasoningDelta(THOUGHT), TextDelta(ANSWER)]
    reader = HarmonyReader()
    assert merged([d for c in "Just text." for d in reader.feed(c)] + reader.finish()) == [TextDelta("Just text.")]
    call = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    reader = HarmonyReader()
    assert merged(reader.feed(f"<|channel|>analysis<|message|>Hm.<|end|>{call}") + reader.finish()) == \
        [ReasoningDelta("Hm."), TextDelta(call)]  # a call stays whole for a tool-call reader
    assert think_tags(GPT_OSS) is HARMONY


def test_gpt_oss_thinking_comes_back_split(server):
    """The tiny vocabulary has gpt-oss's control tokens: llama.cpp loads <|channel|>, <|message|>,
    <|start|> and <|end|> as user-defined (rendered), as it does for gpt-oss's own vocabulary."""
    model = Model(cached_tiny_llama(chat_template=GPT_OSS, control_tokens=HARMONY_TOKENS))
    end = model.tokenize("<|end|>", add_special=False, parse_special=True)
    assert len(end) == 1 and model.piece(end[0]) == b"<|end|>" and not model.is_eog(end[0])
    with server.client() as client:
        message = _chat(client, "gpt-oss", CHANNELS, stream=False, max_tokens=200)["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
        chunks = _chat(client, "gpt-oss", CHANNELS, stream=True, max_tokens=200)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
        assert "".join(d.get("content") or "" for d in deltas) == ANSWER
        anthropic = client.post("/v1/messages", json={"model": "gpt-oss", "max_tokens": 200, "messages": ASK,
                                                      "grammar": _gbnf(CHANNELS)}).json()
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in anthropic["content"]] == \
        [("thinking", THOUGHT), ("text", ANSWER)]


def test_gpt_oss_reads_an_earlier_turns_reasoning_as_thinking():
    """gpt-oss's template renders a tool-calling turn's analysis from `thinking`: reasoning_content
    is passed under that name too."""
    from pflash_plugin.chat.reasoning import for_template
    from pflash_plugin.server.runtime.prompts import Prompts

    prompts = Prompts(Model(cached_tiny_llama(chat_template=GPT_OSS, control_tokens=HARMONY_TOKENS)), None, {}, 2048)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "Weather, then."}
    messages = [*ASK, turn, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tools = [{"type": "function", "function": {**WEATHER[0]["function"], "description": "The weather."}}]
    with_thought = prompts.render_chat(for_template(messages, HARMONY), tools).tokens
    assert len(with_thought) > len(prompts.render_chat(messages, tools).tokens)
    assert "<|channel|>analysis<|message|>Weather, then.<|end|>" in prompts.model.detokenize(with_thought)
    assert for_template(messages, THINK) is messages


def test_a_requests_reasoning_format_overrides_the_models(server):
    with server.client() as client:
        raw = _chat(client, "qwen35", WRITTEN, stream=False, reasoning_format="none")["choices"][0]["message"]
        split = _chat(client, "raw", WRITTEN, stream=False, reasoning_format="auto")["choices"][0]["message"]
        chatml = _chat(client, "chatml", WRITTEN, stream=False)["choices"][0]["message"]
        read = _chat(client, "chatml", WRITTEN, stream=False, reasoning_format="deepseek")["choices"][0]["message"]
        bad = client.post("/v1/chat/completions", json={"model": "qwen35", "messages": ASK, "reasoning_format": "x"})
    assert (raw["reasoning_content"], raw["content"]) == (None, WRITTEN)
    assert (split["reasoning_content"], split["content"]) == (THOUGHT, ANSWER)
    assert (chatml["reasoning_content"], chatml["content"]) == (None, WRITTEN)
    assert (read["reasoning_content"], read["content"]) == (THOUGHT, ANSWER)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_format"


# the generation prompt of llama.cpp's DeepSeek-R1-Distill-Qwen-32B template (models/templates), which
# closes the block unless enable_thinking is set, as llama-server always sets it
R1_DISTILL_END = CHATML_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{% if not enable_thinking %}{{- '</think>' -}}{% endif %}{% endif %}")


def test_templates_that_think_only_when_asked_think_by_default():
    with live_server([{"model": str(cached_tiny_llama(chat_template=R1_DISTILL_END)), "model_alias": "r1d",
                       "n_ctx": 512, "n_threads": 1, "n_threads_batch": 1}]) as live, live.client() as client:
        message = _chat(client, "r1d", AFTER_OPEN, stream=False)["choices"][0]["message"]
        off = _chat(client, "r1d", ANSWER, stream=False, reasoning_effort="none")["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    assert (off["reasoning_content"], off["content"]) == (None, ANSWER)


def test_past_the_thinking_budget_the_server_closes_the_block_and_the_model_answers(server):
    """llama-server's thinking_budget_tokens on chat, Anthropic's thinking.budget_tokens on Messages:
    the random model never closes the block the Qwen3.5 prompt opened, so without a budget its whole
    answer is thinking; with one, its first tokens are, and the rest is the answer after the tag the
    server wrote (engine/reasoning_budget.py)."""
    body = {"model": "qwen35", "messages": ASK, "max_tokens": 40, "min_tokens": 40, "temperature": 0}
    with server.client() as client:
        unbounded = client.post("/v1/chat/completions", json=body).json()
        bounded = client.post("/v1/chat/completions", json={**body, "thinking_budget_tokens": 6}).json()
        claude = client.post("/v1/messages", json={
            "model": "qwen35", "max_tokens": 40, "temperature": 0, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 6}}).json()
    assert unbounded["choices"][0]["message"]["content"] in (None, "")
    assert unbounded["usage"]["completion_tokens_details"]["reasoning_tokens"] == 40
    message = bounded["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    # the block's tokens: the 6 thought, then the tag's (at most its 8 bytes in this byte vocabulary)
    assert 6 <= bounded["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 6 + len("</think>")
    assert [block["type"] for block in claude["content"]] == ["thinking", "text"], claude
