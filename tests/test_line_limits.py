"""A code editor's stop rules on lines (llama-server's n_indent and t_max_predict_ms), fed text as
the engine releases it, in pieces that split lines anywhere."""
from __future__ import annotations

import pytest

from pflash_plugin.engine.line_limits import LineLimits, LineRule


def _fed(limits: LineLimits, pieces: list[str], elapsed_ms: float = 0.0) -> tuple[str, bool]:
    rule = LineRule(limits)
    return "".join(rule.feed(piece, elapsed_ms) for piece in pieces), rule.ended


@pytest.mark.parametrize("pieces, expected", [
    (["x = 1\n", "    y = 2\n", "z = 3\n"], ("x = 1\n    y = 2\n", True)),  # cut before the dedented line's text
    (["if a:", "\n  ", "  b\n    c"], ("if a:\n    b\n    c", False)),
    (["a\n", "\n    b"], ("a\n", True)),  # an empty line ends it, as llama-server reads one
    (["a\n", "    \n", "b"], ("a\n    \n", True)),  # a blank line indented enough passes; the next is read
    (["  ", "  a\n", "\t\t\t\tb\n  c"], ("    a\n\t\t\t\tb\n  ", True)),  # the first line is never checked; tabs count
])
def test_n_indent(pieces, expected):
    assert _fed(LineLimits(n_indent=4), pieces) == expected


def test_t_max_ends_at_a_newline_once_the_time_is_up():
    assert _fed(LineLimits(t_max_ms=50), ["a b", "c\nd", "e\n"], elapsed_ms=60) == ("a bc\nd", True)
    assert _fed(LineLimits(t_max_ms=50), ["a b", "c\nd", "e\n"], elapsed_ms=10) == ("a bc\nde\n", False)
    assert not LineLimits() and LineLimits(t_max_ms=1.0)
