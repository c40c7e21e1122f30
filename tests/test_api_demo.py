"""One request of each newer API to the demo model (Gemma 3 270M, its 262K vocabulary, the gemma
chat format): the Responses API and Anthropic's Messages API, whole and streamed, through their
SDKs. The base model echoes the user's turn, so what is checked is the path, not its wisdom: real
tokens detokenized alike whole and streamed, and a stop sequence cut out of real text."""
from __future__ import annotations

import anthropic
import openai
import pytest

from conftest import live_server

pytestmark = pytest.mark.demo
ASK = "The vault access code is 4817.\n\nQuestion: What is the vault access code?"


@pytest.fixture(scope="module")
def server(demo_model):
    model = {"model": str(demo_model), "model_alias": "demo", "n_ctx": 1024, "max_concurrency": 2,
             "chat_format": "gemma"}
    with live_server([model]) as live:
        yield live


def test_a_response_whole_and_streamed(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="demo", input=ASK, instructions="Answer briefly.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and whole.usage.output_tokens == 12 and "vault" in whole.output_text
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text


def test_a_message_whole_and_streamed_with_a_stop_sequence(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model="demo", max_tokens=24, messages=[{"role": "user", "content": ASK}], extra_body={"temperature": 0})
    text = client.messages.create(**kw).content[0].text
    assert " code" in text, text
    cut = client.messages.create(stop_sequences=[" code"], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == " code"
    assert cut.content[0].text == text[:text.index(" code")]
    with client.messages.stream(stop_sequences=[" code"], **kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == cut.content[0].text and final.stop_sequence == " code"


def test_the_constraint_vocabulary_is_built_before_the_server_is_ready(server):
    """llguidance's tokenizer of the 262K vocabulary holds the GIL for seconds while it is built: built
    after the server said it was ready, it froze the first requests (a 5-token prompt's first token
    3.4-4.0 s late on 2 cores). The live server is serving here, so the build is behind it."""
    from pflash_plugin.llama import guidance

    served = server.app.state.models.get("demo")
    assert served.model in guidance._TOKENIZERS
