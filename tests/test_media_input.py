"""Media in (issue 46), the API side without a model: each API's media parts read into sources
named by the client's fields, their bytes decoded, sniffed and bounded (each limit before the work
it bounds), URLs fetched only from listed hosts (a real loopback HTTP server), and the parts
rendered as the media marker where the client put them."""
from __future__ import annotations

import base64
import http.server
import threading
import time
from typing import Iterator

import pytest

from pflash_plugin.chat.vision_formats import VisionFormat
from pflash_plugin.engine.media import MEDIA_MARKER
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.server.operations.media_fetch import FetchLimits
from pflash_plugin.server.runtime.media_reader import MediaLimits, MediaReader
from pflash_plugin.server.wire.anthropic_protocol import MessagesRequest
from pflash_plugin.server.wire.anthropic_protocol import chat_request as anthropic_chat
from pflash_plugin.server.wire.chat_content import chat_messages
from pflash_plugin.server.wire.media_bytes import decoded_base64, image_size, sniff
from pflash_plugin.server.wire.media_parts import MediaSource, url_source
from pflash_plugin.server.wire.protocol import ChatCompletionRequest, RequestError
from pflash_plugin.server.wire.responses_protocol import ResponsesRequest
from pflash_plugin.server.wire.responses_protocol import chat_request as responses_chat
from pflash_plugin.testing.media_files import bmp_header, data_url, gif_header, jpeg_header, png, wav

PNG = png(16, 12)


def reader(kinds=("image",), hosts=(), max_bytes=1 << 20, max_items=4, max_pixels=10_000,
           timeout_s=2.0) -> MediaReader:
    return MediaReader(MediaLimits(max_items, max_pixels, FetchLimits(frozenset(hosts), max_bytes, timeout_s)),
                       frozenset(kinds))


def refused(call, *args) -> RequestError:
    with pytest.raises(RequestError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value


def image_source(url: str, where: str = "messages.0.content.1.image_url.url") -> MediaSource:
    return MediaSource("image", where, url=url)


# --- bytes: magic, header sizes, base64 ---------------------------------------------------------

@pytest.mark.parametrize("data, mime", [
    (PNG, "image/png"), (jpeg_header(640, 480), "image/jpeg"), (gif_header(3, 4), "image/gif"),
    (bmp_header(5, -6), "image/bmp"), (b"RIFF\x00\x00\x00\x00WEBPVP8X", "image/webp"), (wav(), "audio/wav"),
    (b"fLaC\x00\x00", "audio/flac"), (b"ID3\x04\x00", "audio/mpeg"), (b"\xff\xfb\x90\x00", "audio/mpeg"),
])
def test_formats_are_known_by_their_magic(data, mime):
    assert sniff(data).mime == mime


def test_text_and_truncated_bytes_are_no_format():
    assert sniff(b"hello, world") is None and sniff(b"\x89PN") is None and sniff(b"") is None


@pytest.mark.parametrize("data, mime, size", [
    (PNG, "image/png", (16, 12)), (jpeg_header(640, 480), "image/jpeg", (640, 480)),
    (gif_header(3, 4), "image/gif", (3, 4)), (bmp_header(5, -6), "image/bmp", (5, 6)),
    (PNG[:20], "image/png", None), (b"\xff\xd8\xff\xe0\x00", "image/jpeg", None),
])
def test_image_sizes_come_from_the_header(data, mime, size):
    assert image_size(data, mime) == size


def test_base64_over_the_limit_is_refused_before_it_is_decoded():
    huge = "!" * 4000  # not base64 at all: the size is what is said, so nothing was decoded
    error = refused(decoded_base64, huge, "x", 1000)
    assert "over the server's limit of 1,000" in error.message and "--media_max_bytes" in error.message


def test_base64_with_line_breaks_is_sized_without_them():
    wrapped = base64.encodebytes(bytes(1000)).decode()  # 1,000 bytes in 1,368 characters with line breaks
    assert len(decoded_base64(wrapped, "x", 1000)) == 1000
    assert "1,002 bytes" in refused(decoded_base64, base64.encodebytes(bytes(1002)).decode(), "x", 1000).message


def test_base64_with_line_breaks_decodes_and_bad_base64_is_named():
    text = base64.encodebytes(PNG).decode()  # 76-character lines
    assert decoded_base64(text, "x", 1 << 20) == PNG
    assert refused(decoded_base64, "abc$", "messages.0.content.0.image_url.url", 100).param == \
        "messages.0.content.0.image_url.url"


# --- the reader: projector, counts, kinds, types, pixels ----------------------------------------

def test_no_projector_names_the_flag():
    error = refused(reader(kinds=()).read, [image_source(data_url(PNG, "image/png"))])
    assert error.param == "messages.0.content.1.image_url.url" and "--mmproj" in error.message


def test_too_many_items_are_refused_before_any_is_decoded():
    bad = image_source("data:image/png;base64,@@@@")  # would be a base64 error if decoded
    error = refused(reader(max_items=2).read, [bad] * 3)
    assert "--media_max_items" in error.message


def test_audio_where_the_projector_takes_none():
    audio = MediaSource("audio", "messages.0.content.0.input_audio.data", data=base64.b64encode(wav()).decode(),
                        mime="audio/wav")
    assert "takes no audio" in refused(reader().read, [audio]).message
    assert reader(kinds=("image", "audio")).read([audio])[0].mime == "audio/wav"


@pytest.mark.parametrize("url, words", [
    (data_url(b"not an image at all", "image/png"), "no format"),
    (data_url(PNG, "image/jpeg"), "declared as image/jpeg, but the bytes are image/png"),
    (data_url(wav(), "audio/wav"), "where an image is expected"),
    (data_url(PNG[:20], "image/png"), "corrupt"),
    (data_url(png(200, 100), "image/png"), "200x100 = 20,000 pixels"),
    (data_url(b"RIFF\x00\x00\x00\x00WEBPVP8X" + bytes(10), "image/webp"), "WebP"),
    ("data:image/png," + "x" * 10, "base64 encoded"),
    ("data:image/png;base64,%%%%", "not valid base64"),
])
def test_bad_images_are_each_a_400_naming_the_field(url, words):
    error = refused(reader().read, [image_source(url)])
    assert words in error.message and error.param == "messages.0.content.1.image_url.url"


def test_a_good_image_in_every_spelling():
    raw = base64.b64encode(PNG).decode()
    for source in (image_source(data_url(PNG, "image/png")), image_source(data_url(PNG, "image/PNG")),
                   MediaSource("image", "x", data=raw), MediaSource("image", "x", data=raw, mime="image/png")):
        item = reader().read([source])[0]
        assert (item.kind, item.data, item.mime) == ("image", PNG, "image/png")


# --- URLs: the allow-list, private addresses, redirects, size and time --------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes, float]] = {}
    hits: list[str] = []

    meet: threading.Barrier | None = None  # /meet*: answered once every party's request has arrived

    def do_GET(self) -> None:  # noqa: N802
        self.hits.append(self.path)
        status, headers, body, delay = self.routes.get(self.path, (404, {}, b"", 0.0))
        if self.path.startswith("/meet") and self.meet is not None:
            try:
                self.meet.wait()
                status, headers, body = 200, {"Content-Type": "image/png"}, PNG
            except threading.BrokenBarrierError:
                status = 503
        time.sleep(delay)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client gave up (the timeout case)
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    """A real HTTP server on loopback: 127.0.0.1:port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host = f"127.0.0.1:{server.server_address[1]}"
    _Handler.routes.update({
        "/cat.png": (200, {"Content-Type": "image/png"}, PNG, 0.0),
        "/big.png": (200, {"Content-Type": "image/png"}, PNG + bytes(5000), 0.0),
        "/slow.png": (200, {"Content-Type": "image/png"}, PNG, 1.5),
        "/hop": (302, {"Location": "/cat.png"}, b"", 0.0),
        "/away": (302, {"Location": f"http://localhost:{server.server_address[1]}/cat.png"}, b"", 0.0),
        "/page": (200, {"Content-Type": "text/html"}, b"<html></html>", 0.0),
        "/mislabeled": (200, {"Content-Type": "text/html; charset=utf-8"}, PNG, 0.0),
    })
    yield host
    server.shutdown()


def test_a_url_is_not_fetched_from_a_host_off_the_list(origin):
    error = refused(reader(hosts=["example.com"]).read, [image_source(f"http://{origin}/unlisted.png")])
    assert "--media_hosts" in error.message and "127.0.0.1" in error.message
    assert "names no host" in refused(reader().read, [image_source(f"http://{origin}/unlisted.png")]).message
    assert "/unlisted.png" not in _Handler.hits  # never asked for


def test_a_listed_name_that_resolves_to_loopback_is_not_fetched(origin):
    port = origin.split(":")[1]
    error = refused(reader(hosts=["localhost"]).read, [image_source(f"http://localhost:{port}/local.png")])
    assert "private or local address" in error.message and "/local.png" not in _Handler.hits


def test_a_listed_loopback_address_is_fetched_and_checked(origin):
    listed = reader(hosts=["127.0.0.1"], max_bytes=4000, timeout_s=0.8)
    item = listed.read([image_source(f"http://{origin}/cat.png")])[0]
    assert item.data == PNG and item.mime == "image/png"
    assert listed.read([image_source(f"http://{origin}/hop")])[0].data == PNG  # a redirect on the list
    for path, words in (("/away", "does not list it"), ("/big.png", "--media_max_bytes"),
                        ("/slow.png", "could not be fetched"), ("/missing.png", "HTTP 404"),
                        ("/page", "no format"), ("/mislabeled", "declared as text/html")):
        assert words in refused(listed.read, [image_source(f"http://{origin}{path}")]).message, path


def test_a_requests_urls_are_fetched_at_once_and_the_first_bad_one_in_order_is_refused(origin):
    """Four URLs whose server answers only once all four requests are in (a barrier: fetched one
    after another, the first waits out its timeout and gets a 503)."""
    _Handler.meet = threading.Barrier(4, timeout=5)
    try:
        listed = reader(hosts=["127.0.0.1"], timeout_s=10)
        items = listed.read([image_source(f"http://{origin}/meet{i}.png", f"m.{i}") for i in range(4)])
        assert [item.data for item in items] == [PNG] * 4
    finally:
        _Handler.meet = None
    listed = reader(hosts=["127.0.0.1"])
    for paths, where in ((["/missing.png", "/slow.png"], "m.0"), (["/cat.png", "/page"], "m.1")):
        sources = [image_source(f"http://{origin}{path}", f"m.{i}") for i, path in enumerate(paths)]
        assert refused(listed.read, sources).param == where


def test_other_schemes_are_refused():
    error = refused(url_source, "image", "file:///etc/passwd", "messages.0.content.0.image_url")
    assert "http(s) URL, a data URL or base64" in error.message


# --- each API's parts, named by the client's fields; the marker where the part was --------------

def test_chat_parts_become_markers_in_place():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
        {"type": "text", "text": "between"}, {"type": "image_url", "image_url": "BASE64DATA"},
        {"type": "text", "text": "last"}]}]})
    messages, sources = chat_messages(body.messages)
    assert messages[0]["content"] == f"first{MEDIA_MARKER}between{MEDIA_MARKER}last"
    assert [(s.where, s.url, s.data) for s in sources] == [
        ("messages.0.content.1.image_url.url", "data:x", None), ("messages.0.content.3.image_url", None, "BASE64DATA")]


def test_text_parts_alone_join_by_newlines_as_before():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert chat_messages(body.messages) == ([{"role": "user", "content": "a\nb"}], [])


def test_an_image_in_a_system_message_is_refused():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
    error = refused(chat_messages, body.messages)
    assert error.param == "messages.0.content.0.image_url.url" and "system message" in error.message


def test_input_audio_needs_a_known_format():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}]}]})
    assert refused(chat_messages, body.messages).param == "messages.0.content.0.input_audio.format"


def test_responses_input_image_is_named_by_its_own_field():
    body = ResponsesRequest(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}])
    messages, sources = chat_messages(responses_chat(body).messages)
    assert messages[0]["content"] == f"what is it?{MEDIA_MARKER}"
    assert sources[0].where == "input.0.content.1.image_url"
    file_part = ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}])
    assert refused(responses_chat, file_part).param == "input.0.content.0.file_id"


def test_messages_image_blocks_base64_and_url():
    body = MessagesRequest(max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpg", "data": "AAAA"}},
        {"type": "text", "text": "and"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    messages, sources = chat_messages(anthropic_chat(body).messages)
    assert messages[0]["content"] == f"{MEDIA_MARKER}and{MEDIA_MARKER}"
    assert [(s.where, s.mime, s.url) for s in sources] == [
        ("messages.0.content.0.source.data", "image/jpeg", None),
        ("messages.0.content.2.source.url", None, "https://example.com/a.png")]
    system = MessagesRequest(max_tokens=4, messages=[{"role": "user", "content": "hi"}], system=[
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}])
    assert refused(lambda: chat_messages(anthropic_chat(system).messages)).param == "system.0.source.data"


def test_a_resent_image_renders_the_same_text():
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG, "image/png")}},
                                          {"type": "text", "text": "what is it?"}]}]
    later = [*first, {"role": "assistant", "content": "a cat"}, {"role": "user", "content": "sure?"}]
    one, _ = chat_messages(ChatCompletionRequest.model_validate({"messages": first}).messages)
    two, _ = chat_messages(ChatCompletionRequest.model_validate({"messages": later}).messages)
    assert two[:1] == one


# --- stock's vision chat formats ----------------------------------------------------------------

def test_llava_format_renders_as_stocks_handler_with_the_marker_for_the_url():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from llama_cpp.llama_chat_format import Llava15ChatHandler
    url = "https://example.com/cat.png"
    stock_messages = [{"role": "system", "content": Llava15ChatHandler.DEFAULT_SYSTEM_MESSAGE},
                      {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                   {"type": "image_url", "image_url": {"url": url}}]}]
    stock = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        Llava15ChatHandler.CHAT_FORMAT).render(messages=stock_messages, add_generation_prompt=True,
                                               eos_token="</s>", bos_token="<s>").replace(url, MEDIA_MARKER)
    ours = VisionFormat("llava-1-5", "", "</s>")(messages=[
        {"role": "user", "content": f"What is it?{MEDIA_MARKER}"}]).prompt
    assert ours == stock and ours.count(MEDIA_MARKER) == 1


def test_media_hosts_take_commas():
    assert ModelSettings(media_hosts=["A.example,b.example", "c.example"]).media_hosts == \
        ["a.example", "b.example", "c.example"]


# --- the projector's keys -----------------------------------------------------------------------

def test_mmproj_and_clip_model_path_are_one_key(tmp_path):
    from pflash_plugin.server.config.llama_params import SettingsRefused, plan
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"")
    assert plan(ModelSettings(model="m.gguf", mmproj=str(projector))).mmproj == str(projector)
    assert plan(ModelSettings(model="m.gguf", clip_model_path=str(projector))).mmproj == str(projector)
    with pytest.raises(SettingsRefused, match="^clip_model_path: .* differ"):
        plan(ModelSettings(model="m.gguf", mmproj=str(projector), clip_model_path="other.gguf"))
    with pytest.raises(SettingsRefused, match="^mmproj: no such file"):
        plan(ModelSettings(model="m.gguf", mmproj=str(tmp_path / "missing.gguf")))


@pytest.mark.parametrize("chat_format, mapped", [("mtmd", None), ("gemma4", None), ("llava-1-5", "llava-1-5"),
                                                 ("minicpm-v-2.6", "minicpm-v-2.6")])
def test_stocks_vision_chat_formats_need_the_projector(tmp_path, chat_format, mapped):
    from pflash_plugin.server.config.llama_params import SettingsRefused, plan
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"")
    assert plan(ModelSettings(model="m.gguf", chat_format=chat_format, clip_model_path=str(projector))).chat_format \
        == mapped
    with pytest.raises(SettingsRefused, match=f"^chat_format: '{chat_format}' is stock's vision handler"):
        plan(ModelSettings(model="m.gguf", chat_format=chat_format))


def test_the_flags_and_the_config_file_take_the_media_keys(tmp_path):
    from pflash_plugin.server.__main__ import parse_settings
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"")
    _, [flags] = parse_settings(["--model", "m.gguf", "--mmproj", str(projector),
                                 "--media_hosts", "a.example,B.example", "--media_max_pixels", "1000"])
    assert (flags.mmproj, flags.media_hosts, flags.media_max_pixels) == \
        (str(projector), ["a.example", "b.example"], 1000)
    config = tmp_path / "config.yaml"
    config.write_text(f"models:\n  - model: m.gguf\n    clip_model_path: {projector}\n    chat_format: llava-1-5\n"
                      "    media_hosts: [img.example]\n")
    _, [model] = parse_settings(["--config_file", str(config)])
    assert (model.clip_model_path, model.chat_format, model.media_hosts) == (str(projector), "llava-1-5",
                                                                             ["img.example"])


def test_responses_input_audio_is_read_as_chats():
    body = ResponsesRequest(input=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav()).decode(), "format": "wav"}}]}])
    _, [source] = chat_messages(responses_chat(body).messages)
    assert (source.kind, source.where, source.mime) == ("audio", "input.0.content.0.input_audio.data", "audio/wav")
    assert reader(kinds=("audio",)).read([source])[0].data == wav()


def test_llava_format_renders_a_text_turn_once():
    """Given a string, stock's llava-1-5 template writes the user turn twice; given parts, once."""
    prompt = VisionFormat("llava-1-5", "", "</s>")(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
        {"role": "user", "content": f"{MEDIA_MARKER}again"}]).prompt
    assert prompt.endswith("USER: hiASSISTANT: yesUSER: <__media__>againASSISTANT: ") and prompt.count("USER:") == 2
