"""TextStream: incremental UTF-8 decoding and stop strings across token boundaries."""
from __future__ import annotations

import random
import time

import pytest

from pflash_plugin.engine.text_stream import TextStream
from pflash_plugin.server.wire.protocol import MAX_STOP_CHARS, MAX_STOPS


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


def reference_release(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """The old matcher, slicing every stop's prefixes per push: what a push releases must not change."""
    held, out = "", []
    for piece in pieces:
        held += piece
        cut = min((i for i in (held.find(s) for s in stops if s) if i >= 0), default=-1)
        if cut >= 0:
            out.append(held[:cut])
            return out, True
        keep = max((n for s in stops if s for n in range(min(len(s) - 1, len(held)), 0, -1)
                    if held.endswith(s[:n])), default=0)
        out.append(held[:len(held) - keep])
        held = held[len(held) - keep:]
    return out, False


def test_the_linear_matcher_releases_what_the_slicing_one_did():
    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 4))]
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        stream = TextStream(stops)
        out = []
        for piece in pieces:
            out.append(stream.push(piece.encode()))
            if stream.stopped:
                break
        assert (out, stream.stopped) == reference_release(pieces, stops), (stops, pieces)


def test_a_push_costs_time_linear_in_its_text_whatever_the_stops():
    """Issue 22: 350 stops of 20,000 characters and pushes that match their prefixes made each push
    slice every prefix (1.4 s a push at 1,000 tokens). At the server's caps (32 stops of 1,024
    characters), 2,000 such pushes take well under a second (the old matcher: about 12 ms each)."""
    # the last stop keeps 1,022 characters held; the others' prefixes were each sliced in turn
    stops = ["c" * (MAX_STOP_CHARS - 1) + str(i) for i in range(MAX_STOPS - 1)] + [("ab" * 600)[:1023] + "z"]
    stream = TextStream(stops)
    started = time.perf_counter()
    released = "".join(stream.push(b"ab") for _ in range(2000))
    assert not stream.stopped and len(released) == 4000 - 1022
    assert time.perf_counter() - started < 1.0
