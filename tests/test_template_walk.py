"""Every chat template of llama.cpp's models/templates (tests/data/templates) renders the standard
conversations as the server renders them (server/preparation/prepare.py's chat_prompt: tools, earlier calls and
their results, reasoning of an earlier turn, a prefill continued), or the server refuses it at start
in one line; a walk over them all, on a tiny model that carries each template."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pflash_plugin.chat.reasoning import requested_tags, think_tags
from pflash_plugin.llama import Model
from pflash_plugin.server.preparation.prepare import chat_prompt
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.server.runtime.media_reader import MediaLimits, MediaReader
from pflash_plugin.server.runtime.prompts import Prompts
from pflash_plugin.server.wire.protocol import ChatCompletionRequest
from pflash_plugin.testing import cached_tiny_llama

TEMPLATES = sorted((Path(__file__).parent / "data" / "templates").glob("*.jinja"))
# templates that cannot render a plain conversation, refused at start: the tool-use variants a GGUF
# carries beside its default template (they need tools; Command R+'s in Cohere's own tool shape), and
# Firefunction v2's (it needs `functions` and `datetime` variables its serving code passes)
REFUSED = {"CohereForAI-c4ai-command-r-plus-tool_use.jinja", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
           "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "fireworks-ai-llama-3-firefunction-v2.jinja"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_0f3a9c2b7d4e41a8b6c5d2e1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
SHAPES = {
    "system and user": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    "a call and its result": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "Sunny, 21 C"}]},
    "an earlier turn's reasoning": {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"}]},
    "a prefill": {"messages": [{"role": "user", "content": "List fruits."},
                               {"role": "assistant", "content": '["apple",'}]},
}


def served(template: Path) -> SimpleNamespace:
    """What chat_prompt reads of a served model (server/runtime/models.py's ServedModel), the template its own."""
    model = Model(cached_tiny_llama(chat_template=template.read_text()))
    tags = think_tags(model.chat_template())
    return SimpleNamespace(prompts=Prompts(model, None, {}, 4096), template_tags=tags,
                           think_tags=requested_tags(tags, "auto"), settings=SimpleNamespace(chat_template_kwargs=None),
                           media=MediaReader(MediaLimits.of(ModelSettings()), frozenset()))  # no projector


def test_the_walk_has_llama_cpps_templates():
    assert len(TEMPLATES) >= 70 and REFUSED <= {t.name for t in TEMPLATES}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_each_template_renders_the_standard_conversations_or_is_refused_at_start(template):
    if template.name in REFUSED:
        with pytest.raises(ValueError, match="cannot render a plain conversation") as refused:
            served(template)
        assert "\n" not in str(refused.value)
        return
    model = served(template)
    for shape, body in SHAPES.items():
        prompt = chat_prompt(model, ChatCompletionRequest(model="m", **json.loads(json.dumps(body))))[1]
        text = model.prompts.model.detokenize(prompt.tokens)
        assert prompt.tokens, shape
        if shape == "a call and its result":
            assert "Paris" in text and "Sunny, 21 C" in text, text
        if shape == "a prefill":
            assert text.rstrip().endswith('["apple",'), text
