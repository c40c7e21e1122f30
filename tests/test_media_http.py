"""Images over HTTP end to end (issue 46): a tiny model served with a tiny projector (--mmproj),
chat with an image part, plain and streamed, beside a text request; a resent image reuses the
prefix cache. The API side (parsing, limits, 400s) is tested in the API's own tests.

These need libmtmd: they FAIL where llama_cpp was built without it, unless PFLASH_NO_MTMD=1."""
from __future__ import annotations

import base64
import json
import os
import threading

import httpx
import pytest

from pflash_plugin.llama.media import mtmd_available
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.media_files import png

from conftest import live_server

if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
    pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)", allow_module_level=True)

N_IMAGE = 64  # the tiny projector's tokens per image


@pytest.fixture(scope="module")
def server():
    model = {"model": str(cached_tiny_llama()), "model_alias": "vision", "mmproj": str(cached_tiny_projector()),
             "n_ctx": 1024, "max_concurrency": 3, "n_threads": 1, "n_threads_batch": 1, "media_cache_mb": 8,
             "media_encoders": 2}
    with live_server([model]) as live:
        yield live


def image_chat(seed: int, **extra) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png(24, 20, seed)).decode()
    content = [{"type": "text", "text": "what is in the picture"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "vision", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **extra}


def text_chat() -> dict:
    return {"model": "vision", "messages": [{"role": "user", "content": "the water is"}], "max_tokens": 8,
            "temperature": 0}


def post(server, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, body: dict) -> tuple[str, dict | None]:
    text, usage = [], None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            text += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
    return "".join(text), usage


def test_an_image_chat_plain_and_streamed_beside_a_text_chat(server):
    alone = post(server, text_chat())["choices"][0]["message"]["content"]
    results: dict[str, object] = {}

    def run(name: str, call) -> None:
        results[name] = call()

    threads = [threading.Thread(target=run, args=("image", lambda: post(server, image_chat(1)))),
               threading.Thread(target=run, args=("text", lambda: post(server, text_chat())))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    image, text = results["image"], results["text"]
    assert isinstance(image, dict) and isinstance(text, dict)
    assert text["choices"][0]["message"]["content"] == alone  # the image beside it changed nothing
    answer = image["choices"][0]["message"]["content"]
    assert answer and image["usage"]["prompt_tokens"] > N_IMAGE  # the image's tokens count
    streamed_text, usage = streamed(server, image_chat(1))
    assert streamed_text == answer and usage is not None and usage["prompt_tokens"] == image["usage"]["prompt_tokens"]
    other = post(server, image_chat(2))["choices"][0]["message"]["content"]
    assert other != answer  # the image reaches the model


def test_a_resent_image_reuses_the_prefix_cache(server):
    first = post(server, image_chat(5))
    again = post(server, image_chat(5))
    cached = again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached > N_IMAGE, again["usage"]  # past the image: its KV came from the cache
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    media = httpx.get(f"{server.url}/status", timeout=10).json()["models"]["vision"]["media"]
    assert media["encoded"] >= 1 and media["cache_hits"] >= 1 and 0 < media["cache_bytes"] <= 8 << 20
    assert media["cache_capacity_bytes"] == 8 << 20  # --media_cache_mb
    # --media_encoders, and the phases a bench reads: the encodes' and the embedding decodes' time
    assert media["encoders"] == 2 and media["encode_s"] > 0 and media["tokenized"] >= 2 and media["tokenize_s"] > 0
    assert media["decode_calls"] >= 1 and media["decode_rows"] >= N_IMAGE and media["decode_s"] > 0


def test_pflash_compresses_the_text_around_an_image_and_keeps_the_image():
    from conftest import NOTES, TINY_PFLASH

    model = {"model": str(cached_tiny_llama()), "model_alias": "vision", "mmproj": str(cached_tiny_projector()),
             "n_ctx": 2048, "max_concurrency": 2, "n_threads": 1, "n_threads_batch": 1, **TINY_PFLASH}
    url = "data:image/png;base64," + base64.b64encode(png(24, 20, 9)).decode()
    content = [{"type": "text", "text": NOTES}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": NOTES + " When does the bridge open?"}]
    with live_server([model]) as live:
        got = post(live, {"model": "vision", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                          "pflash": {"mode": "always"}})
    usage = got["usage"]
    report = usage["timings"]["pflash"]
    assert report["status"] == "compressed" and N_IMAGE < report["kept_tokens"] < usage["prompt_tokens"] // 2
    assert usage["prompt_tokens_details"]["media_tokens"] == N_IMAGE
