"""The native log filter (ggml_ext/log_filter.cpp, llama/log.py): a line of llama.cpp's, ggml's or
libmtmd's below the logger's level is dropped in C and never takes the GIL. A Python callback takes
it for every line, and on a busy process that waited out the switch interval (5 ms) a line: libmtmd
writes 5 debug lines an image as a request's preparation reads it, 2 more as it is encoded."""
from __future__ import annotations

import logging

import pytest

from pflash_plugin.llama import log as llama_log
from pflash_plugin.llama import native
from pflash_plugin.testing import cached_tiny_llama, cached_tiny_projector
from pflash_plugin.testing.media_files import png

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native library is not built")

DEBUG, INFO, WARN, CONT = 1, 2, 3, 5


@pytest.fixture
def routed():
    """The routing as a test sets it, put back to the server's default (warnings and errors) after."""
    yield llama_log.route_llama_log
    llama_log.route_llama_log(False)


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "llama.cpp"]


def test_the_filter_passes_lines_at_the_level_and_their_continuations(routed, caplog):
    sink = llama_log.sink()
    assert sink is not llama_log._callback  # the filter stands in front of the Python callback
    routed(False)
    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):  # Python would take them: C drops them first
        sink(DEBUG, b"dropped ", None)
        sink(CONT, b"and its continuation\n", None)
        sink(INFO, b"info dropped too\n", None)
        sink(WARN, b"a warning ", None)
        sink(CONT, b"continued\n", None)
    assert lines(caplog) == [(logging.WARNING, "a warning continued")]
    caplog.clear()
    routed(True)
    with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
        sink(DEBUG, b"debug ", None)
        sink(CONT, b"passes when verbose\n", None)
    assert lines(caplog) == [(logging.DEBUG, "debug passes when verbose")]


def test_libmtmd_reading_an_image_reaches_python_only_when_verbose(routed, caplog):
    from pflash_plugin.llama import Model
    from pflash_plugin.llama.media import MARKER, Projector

    model = Model(str(cached_tiny_llama()))
    projector = Projector(str(cached_tiny_projector()), model)
    try:
        for verbose in (False, True):
            routed(verbose)
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="llama.cpp"):
                projector.tokenize(MARKER + " what is it", [("image", png(40, 30, 1))])
            seen = lines(caplog)
            assert (len(seen) >= 3) if verbose else seen == [], seen  # libmtmd's debug lines of the image
    finally:
        projector.close()
        model.close()
