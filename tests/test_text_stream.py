"""TextStream: incremental UTF-8 decoding and stop strings across token boundaries."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.text_stream import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.push(p) for p in pieces]


def test_plain_text_passes_through_at_once():
    stream = TextStream([])
    assert feed(stream, [b"Hello", b", ", b"world"]) == ["Hello", ", ", "world"]
    assert stream.flush() == ""
    assert not stream.stopped


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_utf8_character_split_across_tokens(char):
    data = char.encode()
    stream = TextStream([])
    out = feed(stream, [b"a"] + [data[i : i + 1] for i in range(len(data))] + [b"b"])
    assert out[0] == "a"
    assert out[1:-2] == [""] * (len(data) - 1), "a partial character must be held, not emitted"
    assert out[-2] == char
    assert out[-1] == "b"
    assert "\ufffd" not in "".join(out)


def test_utf8_split_two_plus_two():
    data = "😀".encode()
    stream = TextStream([])
    assert stream.push(b"x" + data[:2]) == "x"
    assert stream.push(data[2:] + b"y") == "😀y"


def test_stop_string_across_tokens_cuts_before_it():
    stream = TextStream(["</s>"])
    out = feed(stream, [b"answer", b" <", b"/", b"s", b">", b"more"][:5])
    assert "".join(out) == "answer "
    assert stream.stopped
    # the held "<", "/", "s" were never emitted
    assert out == ["answer", " ", "", "", ""]


def test_stop_string_inside_one_token():
    stream = TextStream(["STOP"])
    assert stream.push(b"abcSTOPdef") == "abc"
    assert stream.stopped


def test_earliest_of_several_stops_wins():
    stream = TextStream(["world", "lo w"])
    assert stream.push(b"hello world") == "hel"
    assert stream.stopped


def test_empty_stop_strings_are_ignored():
    stream = TextStream(["", "END"])
    assert stream.push(b"abc") == "abc"
    assert not stream.stopped


def test_held_back_prefix_released_when_not_a_stop():
    stream = TextStream(["STOP"])
    assert stream.push(b"one ST") == "one "
    assert stream.push(b"ART") == "START"
    assert not stream.stopped


def test_held_back_prefix_released_by_flush():
    stream = TextStream(["STOP"])
    assert stream.push(b"end ST") == "end "
    assert stream.flush() == "ST"
    assert stream.flush() == ""


def test_flush_releases_incomplete_utf8_as_replacement():
    stream = TextStream([])
    assert stream.push("€".encode()[:2]) == ""
    assert stream.flush() == "\ufffd"


@pytest.mark.parametrize(
    "pieces",
    [
        [b"\xff", b"ok"],
        [b"a\x80b", b"ok"],
        [b"\xe2\x82", b"A", b"ok"],  # truncated sequence followed by ASCII
        [b"\xf0\x9f\x98", b"\xf0", b"ok"],
        [b"\xc0\xaf", b"ok"],  # overlong encoding
    ],
)
def test_invalid_bytes_do_not_hang(pieces):
    stream = TextStream([])
    out = feed(stream, pieces)
    assert out[-1].endswith("ok"), f"text after invalid bytes is still held: {out}"
    assert "\ufffd" in "".join(out)
    assert stream.flush() == ""


def test_invalid_bytes_then_stop():
    stream = TextStream(["ok"])
    out = feed(stream, [b"\xff", b"o", b"k"])
    assert "".join(out) == "\ufffd"
    assert stream.stopped


def test_stop_with_multibyte_characters():
    stream = TextStream(["—end"])
    data = "x—end".encode()
    out = feed(stream, [data[i : i + 1] for i in range(len(data))])
    assert "".join(out) == "x"
    assert stream.stopped


def test_overlapping_stop_prefixes_hold_the_longest():
    stream = TextStream(["abcd", "bce"])
    assert stream.push(b"zab") == "z"  # "ab" may start "abcd"
    assert stream.push(b"c") == ""  # "abc" may start "abcd", "bc" may start "bce"
    assert stream.push(b"e") == "a"  # "bce" found: cut before it
    assert stream.stopped
