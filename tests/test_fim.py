"""Fill-in-the-middle (code editors' completion): /v1/completions with a suffix and llama-server's
/infill build the prompt as llama-server's format_prompt_infill does (tools/server/server-common.cpp):
[extra] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID, the suffix first under --spm-infill."""
from __future__ import annotations

import json

import pytest

from pflash_plugin.llama import Model
from pflash_plugin.testing import cached_tiny_llama

from conftest import live_server

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # Qwen's: llama.cpp finds them by their text
REPO = (*FIM, "<|fim_repo|>", "<|file_sep|>")
PREFIX, SUFFIX = "def hello(", "):\n    return <|fim_middle|> 1\n"  # a control token's text in it stays text
FORCED = 'root ::= "world"'  # the answer's shape on a random model


def _settings(tokens: tuple[str, ...], **kw):
    from pflash_plugin.server.config.settings import ModelSettings

    return ModelSettings(**{"model": str(cached_tiny_llama(control_tokens=tokens)), "n_ctx": 512, "verbose": False,
                            "n_threads": 1, "n_threads_batch": 1, **kw})


@pytest.fixture(scope="module")
def served():
    from pflash_plugin.server.runtime.models import ServedModel

    model = ServedModel(_settings(FIM, n_batch=64))
    yield model
    model.close()


@pytest.fixture(scope="module")
def served_repo():
    from pflash_plugin.server.runtime.models import ServedModel

    model = ServedModel(_settings(REPO, spm_infill=True, n_batch=64))
    yield model
    model.close()


def _ids(model: Model, *texts: str) -> list[int]:
    return [model.tokenize(t, add_special=False, parse_special=True)[0] for t in texts]


def _text(model: Model, text: str) -> list[int]:
    return model.tokenize(text, add_special=False, parse_special=False)


def test_the_vocabulary_fim_tokens():
    fim = Model(cached_tiny_llama(control_tokens=REPO), vocab_only=True)
    pre, suf, mid, rep, sep = _ids(fim, *FIM, "<|fim_repo|>", "<|file_sep|>")
    assert (fim.fim.pre, fim.fim.suf, fim.fim.mid, fim.fim.rep, fim.fim.sep) == (pre, suf, mid, rep, sep)
    assert fim.fim.pad is None and fim.fim.missing() == []
    plain = Model(cached_tiny_llama(), vocab_only=True)
    assert plain.fim.missing() == ["prefix", "suffix", "middle"] and plain.fim.rep is None


def test_completion_with_suffix_sends_llama_servers_fim_prompt(served):
    from pflash_plugin.server.preparation.prepare import prepare_completion
    from pflash_plugin.server.wire.protocol import CompletionRequest

    m = served.model
    pre, suf, mid = _ids(m, *FIM)
    expected = [m.bos, pre, *_text(m, PREFIX), suf, *_text(m, SUFFIX), mid]
    gen = prepare_completion(served, CompletionRequest(prompt=PREFIX, suffix=SUFFIX, max_tokens=2))
    assert gen.requests[0].prompt_tokens == expected and gen.prompt_tokens == len(expected)
    ids = m.tokenize(PREFIX, add_special=False)
    gen = prepare_completion(served, CompletionRequest(prompt=ids, suffix="", max_tokens=2))  # ids: the prefix
    assert gen.requests[0].prompt_tokens == [m.bos, pre, *ids, suf, mid]


def test_infill_fits_the_prompt_to_a_batch_as_llama_server(served):
    from pflash_plugin.server.preparation.infill import infill_tokens
    from pflash_plugin.server.wire.infill import InfillRequest

    m = served.model
    pre, suf, mid = _ids(m, *FIM)
    prefix, suffix = "the sound of water " * 20, "hello world " * 20
    body = InfillRequest(input_prefix=prefix, input_suffix=suffix, prompt="    return")
    middle = m.tokenize("    return", add_special=False, parse_special=True)
    # n_batch 64: the prefix's last 48 tokens, the suffix's first 16 - 2 - len(middle)
    kept = _text(m, prefix)[-48:], _text(m, suffix)[:16 - 2 - len(middle)]
    assert infill_tokens(served, body) == [m.bos, pre, *kept[0], *middle, suf, *kept[1], mid]


def test_infill_repo_context_and_spm_order(served_repo):
    from pflash_plugin.server.preparation.infill import infill_tokens
    from pflash_plugin.server.wire.infill import InfillRequest

    m = served_repo.model
    pre, suf, mid, rep, sep = _ids(m, *FIM, "<|fim_repo|>", "<|file_sep|>")
    body = InfillRequest(input_prefix=["a = ", 7], input_suffix="b", prompt="x",
                         input_extra=[{"filename": "util.py", "text": "def f(): pass\n"}, {"text": "z"}])
    extra = [rep, *_text(m, "myproject\n"), sep, *_text(m, "util.py\n"), *_text(m, "def f(): pass\n"),
             sep, *_text(m, "tmp\n"), *_text(m, "z"), sep, *_text(m, "filename\n")]
    spm = [suf, *_text(m, "b"), pre, *_text(m, "a = "), 7, *_text(m, "x"), mid]
    assert infill_tokens(served_repo, body) == [*extra, m.bos, *spm]


@pytest.fixture(scope="module")
def server():
    fim = {"model": str(cached_tiny_llama(control_tokens=FIM)), "model_alias": "coder", "n_ctx": 512,
           "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1}
    plain = {"model": str(cached_tiny_llama()), "model_alias": "plain", "n_ctx": 512, "max_concurrency": 2,
             "n_threads": 1, "n_threads_batch": 1}
    with live_server([fim, plain]) as running:
        yield running


def _events(reply) -> list[dict]:
    lines = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in lines[:-1]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_completions_fill_in_over_http(server):
    body = {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "grammar": FORCED}
    with server.client() as client:
        whole = client.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()
        streamed = client.post("/v1/completions", json={**body, "stream": True})
    choice = whole["choices"][0]
    assert choice["text"] == PREFIX + "world" and choice["finish_reason"] == "stop"  # the prompt echoed, not FIM's
    assert "".join(choice["logprobs"]["tokens"]) == "world"
    assert whole["usage"]["prompt_tokens"] == 4 + len(Model(cached_tiny_llama(control_tokens=FIM), vocab_only=True)
                                                      .tokenize(PREFIX + SUFFIX, add_special=False))
    chunks = _events(streamed)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "world"


def test_infill_over_http(server):
    body = {"model": "coder", "input_prefix": "x = ", "input_suffix": "\n", "prompt": "hello ", "grammar": FORCED,
            "n_predict": 8}
    fields = ["content", "timings/predicted_n", "stop_type"]
    with server.client() as client:
        whole = client.post("/infill", json=body).json()
        picked = client.post("/infill", json={**body, "response_fields": fields}).json()
        streamed = client.post("/infill", json={**body, "stream": True})
        nothing = client.post("/infill", json={**body, "n_predict": 0}).json()
        probs = client.post("/infill", json={**body, "n_probs": 2}).json()["completion_probabilities"]
    assert whole["content"] == "world" and whole["stop"] is True and whole["stop_type"] == "eos"
    assert len(probs) == whole["tokens_predicted"] and all(len(p["top_logprobs"]) == 2 for p in probs)
    vocab = Model(cached_tiny_llama(control_tokens=FIM), vocab_only=True)
    assert whole["tokens_predicted"] == whole["timings"]["predicted_n"] > 0
    assert whole["tokens_evaluated"] == 1 + 3 + sum(len(_text(vocab, t)) for t in ("x = ", "hello ", "\n"))
    assert set(picked) == set(fields) and picked["content"] == "world"
    events = _events(streamed)
    assert "".join(e["content"] for e in events) == "world" and events[-1]["stop"] is True
    assert not any(e["stop"] for e in events[:-1])
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0


def test_a_model_without_fim_tokens_refuses_a_suffix(server):
    with server.client() as client:
        completion = client.post("/v1/completions", json={"model": "plain", "prompt": "a", "suffix": "b"})
        infill = client.post("/infill", json={"model": "plain", "input_prefix": "a", "input_suffix": "b"})
        empty = client.post("/v1/completions", json={"model": "plain", "prompt": "a", "suffix": "", "max_tokens": 2})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in completion.json()["error"]["message"]
    assert infill.status_code == 400 and "fill-in-the-middle" in infill.json()["error"]["message"]
    assert empty.status_code == 200  # nothing after the cursor: a plain completion, as stock answers it


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123, "text": "abc"}])
def test_infill_refuses_what_llama_server_refuses(server, extra):
    with server.client() as client:
        bad = client.post("/infill", json={"model": "coder", "input_prefix": "a", "input_suffix": "b",
                                           "input_extra": [extra]})
        probs = client.post("/infill", json={"model": "coder", "input_prefix": "a", "input_suffix": "b",
                                             "n_probs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input_extra.0")
    assert probs.status_code == 400 and probs.json()["error"]["param"] == "n_probs"


def test_infill_applies_the_editors_line_limits(server):
    """llama.vim's n_indent and t_max_predict_ms end the answer as llama-server's do (stop_type limit)."""
    body = {"model": "coder", "input_prefix": "def f():\n", "input_suffix": "", "n_predict": 64,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500}
    code = 'root ::= "x = 1\\n    y = 2\\nz = 3\\n"'
    slow = 'root ::= "the sound of water the sound of water the sound of water\\nmore\\nend\\n"'
    with server.client() as client:
        indented = client.post("/infill", json={**body, "grammar": code, "n_indent": 4}).json()
        streamed = _events(client.post("/infill", json={**body, "grammar": code, "n_indent": 4, "stream": True}))
        timed = client.post("/infill", json={**body, "grammar": slow, "t_max_predict_ms": 1}).json()
        free = client.post("/infill", json={**body, "grammar": code}).json()
    assert indented["content"] == "x = 1\n    y = 2\n" and indented["stop_type"] == "limit"
    assert "".join(e["content"] for e in streamed) == "x = 1\n    y = 2\n" and streamed[-1]["stop_type"] == "limit"
    assert timed["content"] == "the sound of water the sound of water the sound of water\n"
    assert timed["stop_type"] == "limit"
    assert free["content"] == "x = 1\n    y = 2\nz = 3\n" and free["stop_type"] == "eos"


def test_pflash_leaves_fim_prompts_whole_unless_asked():
    """A FIM prompt's tokens between prefix and suffix are not among the spans compression keeps:
    it is skipped (fill_in_the_middle), as tools and JSON are, unless the request asks."""
    from conftest import NOTES, TINY_PFLASH
    from pflash_plugin.server.preparation.infill import prepare_infill
    from pflash_plugin.server.preparation.prepare import prepare_completion
    from pflash_plugin.server.runtime.models import ServedModel
    from pflash_plugin.server.wire.infill import InfillRequest
    from pflash_plugin.server.wire.protocol import CompletionRequest

    served = ServedModel(_settings(FIM, **{**TINY_PFLASH, "n_ctx": 1024}))
    try:
        plain = prepare_completion(served, CompletionRequest(prompt=NOTES, max_tokens=2)).requests[0]
        fim = prepare_completion(served, CompletionRequest(prompt=NOTES, suffix="x", max_tokens=2)).requests[0]
        asked = prepare_completion(served, CompletionRequest(prompt=NOTES, suffix="x", max_tokens=2,
                                                             pflash={"mode": "always"})).requests[0]
        _, infill = prepare_infill(served, InfillRequest(input_prefix=NOTES, input_suffix="x", n_predict=2))
    finally:
        served.close()
    assert plain.compression is not None and asked.compression is not None
    assert infill is not None
    for skipped in (fim, infill.requests[0]):
        assert skipped.compression is None and skipped.pflash.cause == "fill_in_the_middle"
