"""Images in over HTTP (issue 46), on a tiny model: without a projector every API answers 400
naming --mmproj, in its own error shape; with the tiny projector an image request answers on chat,
Responses and Messages, plain and streamed, its media tokens in usage and /metrics; bad media are
each a 400 that leaves the server serving."""
from __future__ import annotations

import http.server
import json
import os
import threading

import httpx
import pytest

from conftest import hermes_model, live_server
from pflash_plugin.llama.media import mtmd_available
from pflash_plugin.testing import cached_tiny_projector
from pflash_plugin.testing.media_files import data_url, png, wav

PNG = png(24, 20, seed=1)
IMAGE_TOKENS = 64  # the tiny projector's (image_size / patch_size)^2

CHAT = {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": data_url(PNG, "image/png")}}]}],
    "max_tokens": 4, "temperature": 0}
RESPONSES = {"input": [{"role": "user", "content": [
    {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": data_url(PNG, "image/png")}]}],
    "max_output_tokens": 4, "temperature": 0}
MESSAGES = {"messages": [{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                 "data": data_url(PNG, "x").split(",")[1]}},
    {"type": "text", "text": "what is it?"}]}], "max_tokens": 4, "temperature": 0}
ROUTES = {"chat": ("/v1/chat/completions", CHAT), "responses": ("/v1/responses", RESPONSES),
          "messages": ("/v1/messages", MESSAGES)}


@pytest.fixture(scope="module")
def plain():
    with live_server([hermes_model("text")]) as server:
        yield server


def needs_mtmd() -> None:
    """The projector needs libmtmd: these FAIL without it, unless PFLASH_NO_MTMD=1 says it was left out."""
    if os.environ.get("PFLASH_NO_MTMD") == "1" and not mtmd_available():
        pytest.skip("llama_cpp built without libmtmd on purpose (PFLASH_NO_MTMD=1)")


class _Origin(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/cat.png" else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin():
    """An image host on loopback, which the vision server's --media_hosts lists."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def vision():
    needs_mtmd()
    model = hermes_model("vision", mmproj=str(cached_tiny_projector()), media_max_pixels=100_000,
                         media_hosts=["127.0.0.1"])
    with live_server([model]) as server:
        yield server


@pytest.fixture(scope="module")
def llava():
    """Stock's spelling: chat_format llava-1-5 with clip_model_path."""
    needs_mtmd()
    model = {**hermes_model("llava"), "chat_format": "llava-1-5", "clip_model_path": str(cached_tiny_projector())}
    with live_server([model]) as server:
        yield server


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


@pytest.mark.parametrize("api, field", [("chat", "messages.0.content.1.image_url.url"),
                                        ("responses", "input.0.content.1.image_url"),
                                        ("messages", "messages.0.content.0.source.data")])
def test_without_a_projector_each_api_answers_400_naming_the_flag(plain, api, field):
    route, body = ROUTES[api]
    reply = post(plain, route, body)
    assert reply.status_code == 400, reply.text
    if api == "messages":
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        message = error["error"]["message"]
    else:
        error = reply.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error"
        message = error["message"]
    assert message.startswith(field) and "--mmproj" in message


def usage_of(api: str, answer: dict) -> tuple[int, int]:
    """(prompt tokens, media tokens) as the API reports them."""
    if api == "chat":
        usage = answer["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["media_tokens"]
    if api == "responses":
        usage = answer["usage"]
        return usage["input_tokens"], usage["input_tokens_details"]["media_tokens"]
    usage = answer["usage"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"], usage["timings"]["media_tokens"]


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_an_image_request_answers_with_its_media_tokens(vision, api):
    route, body = ROUTES[api]
    reply = post(vision, route, body)
    assert reply.status_code == 200, reply.text
    prompt, media = usage_of(api, reply.json())
    assert media == IMAGE_TOKENS and prompt > media


def stream_events(server, route: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}{route}", json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize("api, last", [("chat", "chat.completion.chunk"),
                                       ("responses", "response.incomplete"),  # at max_output_tokens
                                       ("messages", "message_stop")])
def test_an_image_request_streams(vision, api, last):
    route, body = ROUTES[api]
    extra = {"stream_options": {"include_usage": True}} if api == "chat" else {}
    events = stream_events(vision, route, {**body, **extra})
    assert events and not any("error" in event for event in events)
    kinds = [event.get("type", event.get("object")) for event in events]
    assert kinds[-1] == last
    if api == "chat":
        assert events[-1]["usage"]["prompt_tokens_details"]["media_tokens"] == IMAGE_TOKENS


def chat_with(content: list[dict], role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": content}, *([{"role": "user", "content": "hi"}] if role != "user"
                                                                else [])], "max_tokens": 2}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("body, param, words", [
    (chat_with([image_part(data_url(PNG[:60], "image/png"))]), "messages", "could not decode"),
    (chat_with([image_part(data_url(png(400, 300), "image/png"))]), "messages.0.content.0.image_url.url",
     "--media_max_pixels"),
    (chat_with([image_part(data_url(PNG, "image/gif"))]), "messages.0.content.0.image_url.url", "declared as"),
    (chat_with([image_part("data:image/png;base64,!!!!")]), "messages.0.content.0.image_url.url", "base64"),
    (chat_with([image_part(data_url(PNG, "image/png"))], role="system"), "messages.0.content.0.image_url.url",
     "system message"),
    (chat_with([{"type": "input_audio", "input_audio": {"data": data_url(wav(), "x").split(",")[1],
                                                         "format": "wav"}}]),
     "messages.0.content.0.input_audio.data", "takes no audio"),
    (chat_with([image_part("http://localhost:9/cat.png")]), "messages.0.content.0.image_url.url", "--media_hosts"),
    (chat_with([image_part("http://127.0.0.1:9/cat.png")]), "messages.0.content.0.image_url.url",
     "could not be fetched"),
    (chat_with([{"type": "text", "text": "<__media__>"}, image_part(data_url(PNG, "image/png"))]), "messages",
     "media markers"),
])
def test_bad_media_are_each_a_400_and_the_server_serves_on(vision, body, param, words):
    reply = post(vision, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert post(vision, "/v1/chat/completions", CHAT).status_code == 200


def test_a_resent_image_reuses_the_cached_prefix(vision):
    first = post(vision, "/v1/chat/completions", CHAT).json()
    answer = first["choices"][0]["message"]["content"]
    later = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "are you sure?"}]}
    usage = post(vision, "/v1/chat/completions", later).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > IMAGE_TOKENS


def test_media_tokens_are_counted_in_metrics(vision):
    post(vision, "/v1/chat/completions", CHAT)
    metrics = httpx.get(f"{vision.url}/metrics", timeout=10).text
    name = 'pflash_media_prompt_tokens_total{model_name="vision"}'
    line = next(x for x in metrics.splitlines() if x.startswith(name))
    assert float(line.split()[-1]) >= IMAGE_TOKENS


def test_count_tokens_counts_the_image(vision):
    with_image = post(vision, "/v1/messages/count_tokens", {"messages": MESSAGES["messages"]}).json()
    text_only = post(vision, "/v1/messages/count_tokens", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is it?"}]}]}).json()
    assert with_image["input_tokens"] >= text_only["input_tokens"] + IMAGE_TOKENS


def test_stocks_llava_chat_format_with_clip_model_path_answers(llava):
    reply = post(llava, "/v1/chat/completions", CHAT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens_details"]["media_tokens"] == IMAGE_TOKENS


def test_n_samples_of_an_image_prompt_all_answer(vision):
    reply = post(vision, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 0.8, "seed": 3})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert len(answer["choices"]) == 2 and answer["usage"]["prompt_tokens_details"]["media_tokens"] == IMAGE_TOKENS


def test_an_image_in_a_tool_result_block(vision):
    body = {"max_tokens": 4, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "camera", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            MESSAGES["messages"][0]["content"][0], {"type": "text", "text": "the photo"}]}]}],
        "tools": [{"name": "camera", "input_schema": {"type": "object", "properties": {}}}]}
    reply = post(vision, "/v1/messages", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["timings"]["media_tokens"] == IMAGE_TOKENS


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_an_image_url_from_a_listed_host_is_fetched(vision, origin, api):
    if api == "chat":
        body = {**CHAT, "messages": [{"role": "user", "content": [image_part(f"{origin}/cat.png")]}]}
    else:
        body = {**MESSAGES, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"{origin}/cat.png"}},
            {"type": "text", "text": "what is it?"}]}]}
    reply = post(vision, ROUTES[api][0], body)
    assert reply.status_code == 200, reply.text
    assert usage_of(api, reply.json())[1] == IMAGE_TOKENS


@pytest.fixture(scope="module")
def hearing():
    """A tiny Qwen2-Audio projector (750 tokens a clip's 30 s window) beside the tiny model."""
    needs_mtmd()
    with live_server([hermes_model("audio", mmproj=str(cached_tiny_projector(kind="qwen2a")))]) as server:
        yield server


def test_audio_answers_on_chat_and_responses_streamed_and_plain_and_an_image_is_refused(hearing):
    """input_audio end to end (issue 46): a WAV clip's 750 tokens in usage on chat and Responses,
    plain and streamed; the audio projector takes no image (a 400 naming the part)."""
    clip = data_url(wav(8000), "x").split(",")[1]
    chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what do you hear?"}, {"type": "input_audio", "input_audio": {"data": clip,
                                                                                              "format": "wav"}}]}],
        "max_tokens": 4, "temperature": 0}
    responses = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what do you hear?"},
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]}], "max_output_tokens": 4,
        "temperature": 0}
    for api, route, body in (("chat", "/v1/chat/completions", chat), ("responses", "/v1/responses", responses)):
        reply = post(hearing, route, body)
        assert reply.status_code == 200, reply.text
        prompt, media = usage_of(api, reply.json())
        assert media == 750 and prompt > media
    events = stream_events(hearing, "/v1/chat/completions", chat)
    assert any((e.get("choices") or [{}])[0].get("delta", {}).get("content") for e in events)
    image = post(hearing, "/v1/chat/completions", CHAT)
    assert image.status_code == 400 and "takes no image" in image.json()["error"]["message"]
