"""Where a JSON body is parsed and what its checks cost (issue 46): an image chat's body, hundreds of
KB in one base64 string, is parsed on the event loop (json.loads holds the GIL wherever it runs, and
the hop to a thread and back waited for it: bench/vision.py's prepare_parse_ms), a large body of many
values (token ids) on a worker thread as before (issue 48), and the raw-byte scans before the
checks' walks stay cheap on a large body."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Callable

import pytest

from pflash_plugin.server.wire import errors
from pflash_plugin.server.wire.errors import (
    LOOP_PARSE_BYTES,
    LOOP_PARSE_VALUES,
    MAX_JSON_DEPTH,
    loads,
    may_hold_lone_surrogate,
    more_than,
    parsed_on_loop,
)
from pflash_plugin.testing.media_files import png


def image_chat(side: int = 336, text: str = "Describe the picture.") -> dict:
    url = "data:image/png;base64," + base64.b64encode(png(side, side, 5)).decode()
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def ids_body() -> bytes:
    return json.dumps({"prompt": [7] * (LOOP_PARSE_BYTES // 3), "max_tokens": 1}).encode()


def test_an_image_body_is_parsed_on_the_loop_and_many_values_off_it():
    image = json.dumps(image_chat()).encode()
    assert len(image) > 4 * LOOP_PARSE_BYTES and parsed_on_loop(image)
    assert not parsed_on_loop(ids_body())
    assert parsed_on_loop(json.dumps({"prompt": [7] * 100}).encode())  # small: on the loop, whatever it holds


def test_more_than_counts_up_to_its_limit():
    assert not more_than(b"[" * 64 + b"{" * 64, b"[{", 128)
    assert more_than(b"[" * 64 + b"{" * 65, b"[{", 128)
    assert more_than(b"," * (LOOP_PARSE_VALUES + 1), b",", LOOP_PARSE_VALUES)
    assert not more_than(b"abc", b",", 0)


def test_backslashes_without_a_surrogate_escape_skip_the_walk():
    assert not may_hold_lone_surrogate(json.dumps({"prompt": "a\nb\t\"c\" \\ \u00e9"}).encode())
    assert may_hold_lone_surrogate(b'{"prompt": "a\\n\\udcff"}')


def best_of(runs: int, scan: Callable[[], None]) -> float:
    """The fastest of `runs` calls (s): the least disturbed by the host."""
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        scan()
        took.append(time.perf_counter() - start)
    return min(took)


def test_the_scans_of_a_large_image_body_take_a_fraction_of_whole_body_searches():
    """Before: `b"\\ud" in raw`, `b"\\uD" in raw` and two bytes.count took 0.9 ms of the event loop on
    this 450 KB body (measured on 2 CPU cores), for every image chat; the scans now ~0.13 ms. Timed
    against those searches on the same body in the same process, so a slow host slows both."""
    raw = json.dumps(image_chat(text="line one\nline two")).encode()  # a backslash: the escape search runs

    def scans() -> None:
        may_hold_lone_surrogate(raw)
        more_than(raw, b"[{", MAX_JSON_DEPTH)

    def whole_body() -> None:
        _ = b"\\ud" in raw or b"\\uD" in raw
        _ = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH

    ours, before = zip(*((best_of(5, scans), best_of(5, whole_body)) for _ in range(4)))
    assert min(ours) < 0.5 * min(before), (min(ours), min(before))


def test_where_each_large_body_is_parsed_over_http(tiny_server, monkeypatch):
    """The parse of a large body on the loop's thread (an image chat) or off it (token ids), and
    both still checked: a lone surrogate beside the image is named by its field."""
    on_loop: list[bool] = []

    def watched(raw):
        if len(raw) > LOOP_PARSE_BYTES:
            on_loop.append(asyncio._get_running_loop() is not None)
        return loads(raw)

    monkeypatch.setattr(errors, "loads", watched)
    with tiny_server.client() as client:
        image = client.post("/v1/chat/completions", json=image_chat())
        ids = client.post("/v1/completions", content=ids_body(), headers={"content-type": "application/json"})
        bad = json.dumps(image_chat(text="\udcff")).encode()
        refused = client.post("/v1/chat/completions", content=bad, headers={"content-type": "application/json"})
    assert on_loop[:2] == [True, False], on_loop
    assert image.status_code == 400 and "projector" in image.json()["error"]["message"]  # the tiny model has none
    assert ids.status_code == 400 and "context" in ids.json()["error"]["message"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.0.content.0.text"


@pytest.mark.parametrize("raw", [
    b'{"prompt": [1, 2, 3], "a": 1, "a": 2}',  # both keep the last of a repeated key
    b'[NaN, Infinity, -Infinity]', b'[1e400]',  # orjson refuses these; json.loads reads them
    b'"\\udcff"', b'"\xed\xb3\xbf"',  # a lone surrogate, escaped and as raw bytes (surrogatepass)
    '{"prompt": "\u00e9"}'.encode("utf-16"), b"\xef\xbb\xbf[1]",  # UTF-16 with its BOM; UTF-8's BOM
    b"[" * 1100 + b"]" * 1100,  # deeper than orjson's 1024 levels
])
def test_loads_reads_what_json_loads_reads(raw):
    """Bodies go through orjson (a third of json.loads's GIL time on 22K token ids); whatever orjson
    refuses falls to json.loads, so a body means what it meant before, and errors stay json's."""
    try:
        expected = json.loads(raw)
    except (ValueError, RecursionError) as error:
        with pytest.raises(type(error)):
            loads(raw)
        return
    got = loads(raw)
    assert repr(got) == repr(expected)  # NaN too: the repr compares what == cannot


def test_an_integer_past_64_bits_is_read_as_a_float():
    """orjson's one difference that parses: a seed past 2**64 is rounded (ids and counts that large are a
    400 either way), and llguidance reads a schema's numbers as 64-bit too."""
    assert loads(b"[123456789012345678901234567890, 18446744073709551615]") == [1.2345678901234568e+29,
                                                                                18446744073709551615]


def test_loads_of_token_ids_and_text_matches_json():
    text = "caf\u00e9 \ud83d\ude00 \\n"  # a surrogate pair, escaped by dumps: one emoji
    raw = json.dumps({"prompt": list(range(5000)), "text": text, "x": [0.1, -0.0, 5e-324]}).encode()
    assert loads(raw) == json.loads(raw)
    with pytest.raises(ValueError):
        loads(b'{"prompt": [1, 2,')
