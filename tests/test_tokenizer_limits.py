"""Issue 31: the tokenizer routes take the completion routes' caps. A text too long for max_ctx tokens
is refused before llama.cpp tokenizes it (a 7 MB body on /extras/tokenize peaked at 848 MB), a token
list over max_ctx is refused, each with a 400 naming max_ctx; what fits is answered as before."""
from __future__ import annotations

import time

import httpx
import pytest

from pflash_plugin.llama import Model
from pflash_plugin.server.wire.protocol import RequestError
from pflash_plugin.server.runtime.text_limits import TextLimit
from pflash_plugin.testing.native_fuzz import server_process

MAX_CTX = 512  # server_process's n_ctx
BIG = "word " * 1_400_000  # 7 MB


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with server_process(tiny_model, tmp_path_factory.mktemp("tokenizer") / "server.log") as server:
        yield server


def peak_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise KeyError("VmHWM")


def refused(answer: httpx.Response, param: str) -> str:
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text[:500]
    return answer.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/extras/tokenize", {"input": BIG}, "input"),
    ("/extras/tokenize/count", {"input": BIG}, "input"),
    ("/v1/completions", {"prompt": BIG, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1}, "messages"),
], ids=["tokenize", "count", "completions", "chat"])
def test_a_7mb_text_is_refused_untokenized_naming_max_ctx(server, path, body, param):
    before = peak_kib(server.proc.pid)
    started = time.monotonic()
    message = refused(httpx.post(server.url + path, json=body, timeout=60), param)
    assert time.monotonic() - started < 2.0
    assert f"max_ctx ({MAX_CTX} tokens)" in message and "7,000,0" in message, message  # the template adds a few
    assert peak_kib(server.proc.pid) - before < 50 * 1024  # the body itself is parsed, nothing more


def test_a_text_under_the_character_cap_but_over_max_ctx_tokens_is_refused_once_tokenized(server):
    text = "hi " * 600  # a few characters a token: not refused untokenized
    message = refused(httpx.post(server.url + "/extras/tokenize", json={"input": text}, timeout=60), "input")
    assert f"over max_ctx ({MAX_CTX})" in message, message


def test_detokenize_takes_at_most_max_ctx_tokens(server):
    message = refused(httpx.post(server.url + "/extras/detokenize", json={"tokens": [5] * (MAX_CTX + 1)}, timeout=60),
                      "tokens")
    assert f"{MAX_CTX + 1} tokens are over max_ctx ({MAX_CTX})" in message
    answer = httpx.post(server.url + "/extras/detokenize", json={"tokens": [5] * MAX_CTX}, timeout=60)
    assert answer.status_code == 200, answer.text


def test_what_fits_is_answered(server):
    answer = httpx.post(server.url + "/extras/tokenize", json={"input": "hello world"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["tokens"]
    count = httpx.post(server.url + "/extras/tokenize/count", json={"input": "hello world"}, timeout=60)
    assert count.json()["count"] == len(answer.json()["tokens"])


def test_the_character_cap_never_refuses_a_text_that_fits(tiny_model):
    """At the edge: the tiny vocabulary's longest token is `<|im_start|>` (12 characters, parsed as
    one special token, as prompts are). As many as max_ctx holds pass and fit; one character more
    than max_ctx of them can hold is refused."""
    model = Model(tiny_model)
    longest = "<|im_start|>"
    assert model.longest_piece() == len(longest)
    limit = TextLimit(model, max_tokens=64)
    text = longest * 64
    limit.check_text(text, "prompt")
    assert len(model.tokenize(text, add_special=False, parse_special=True)) == 64
    with pytest.raises(RequestError) as caught:
        limit.check_text(text + "x", "prompt")
    assert caught.value.param == "prompt" and "max_ctx (64 tokens)" in caught.value.message


def test_too_many_prompts_are_refused_before_any_is_tokenized(server):
    """10,000 prompts of 500 characters each (each under the cap): refused for n before tokenizing."""
    before = peak_kib(server.proc.pid)
    body = {"prompt": ["word " * 100] * 10_000, "max_tokens": 1}
    message = refused(httpx.post(server.url + "/v1/completions", json=body, timeout=60), "n")
    assert "10000 prompts" in message
    assert peak_kib(server.proc.pid) - before < 50 * 1024
