"""Selection must respect the budget exactly, always keep mandatory spans, and spend
the budget on the highest-scoring segments; segmentation must tile the prompt."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import pytest

from pflash_plugin.pflash.selection import (
    KeepCurve,
    Segment,
    Selection,
    TokenBoundaries,
    boundary_flags,
    budget_for,
    fixed_segments,
    segment_tokens,
    select,
)


def spans(*pairs: tuple[int, int]) -> list[Segment]:
    return [Segment(a, b) for a, b in pairs]


# ---------------------------------------------------------------- select: properties


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    n_cuts = int(rng.integers(0, min(n, 30)))
    cuts = sorted(set(rng.integers(1, n, size=n_cuts).tolist())) if n > 1 else []
    bounds = [0, *cuts, n]
    segments = [Segment(a, b) for a, b in zip(bounds, bounds[1:])]
    mandatory = []
    for _ in range(int(rng.integers(0, 4))):
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 1))
        mandatory.append(Segment(a, b))
    mass = rng.random(int(rng.integers(0, n + 1)))
    budget = int(rng.integers(1, n + 10))
    return n, segments, mandatory, mass, budget


def candidate_parts(segments: list[Segment], mandatory_mask: np.ndarray) -> list[Segment]:
    """Maximal runs of non-mandatory tokens inside each segment, computed token by token."""
    parts = []
    for seg in segments:
        start = None
        for i in range(seg.start, seg.end):
            if not mandatory_mask[i] and start is None:
                start = i
            if mandatory_mask[i] and start is not None:
                parts.append(Segment(start, i))
                start = None
        if start is not None:
            parts.append(Segment(start, seg.end))
    return parts


@pytest.mark.parametrize("seed", range(400))
def test_random_selection_properties(seed: int) -> None:
    n, segments, mandatory, mass, budget = random_case(seed)
    mandatory_mask = np.zeros(n, dtype=bool)
    for span in mandatory:
        mandatory_mask[span.start : span.end] = True
    n_mandatory = int(mandatory_mask.sum())

    result = select(mass, segments, budget, mandatory)

    if n_mandatory > budget:
        assert result is None
        return
    assert result is not None
    indices = result.token_indices()
    # Budget is strict and the count is honest.
    assert result.kept_tokens == len(indices) <= budget
    # Source order, no duplicates, inside the prompt.
    assert indices == sorted(set(indices))
    assert all(0 <= i < n for i in indices)
    # Kept ranges are merged: non-empty and separated by a gap.
    assert all(s.start < s.end for s in result.kept)
    assert all(a.end < b.start for a, b in zip(result.kept, result.kept[1:]))
    # Mandatory tokens are always kept.
    kept_mask = np.zeros(n, dtype=bool)
    kept_mask[indices] = True
    assert kept_mask[mandatory_mask].all()
    # Other tokens are kept or dropped a whole candidate at a time.
    parts = candidate_parts(segments, mandatory_mask)
    chosen = [p for p in parts if kept_mask[p.start : p.end].all()]
    assert all(not kept_mask[p.start : p.end].any() for p in parts if p not in chosen)
    assert result.segments_total == len(parts) + len(mandatory)
    assert result.segments_kept == len(chosen) + len(mandatory)
    # Greedy never leaves room for a dropped candidate.
    left = budget - result.kept_tokens
    assert all(len(p) > left for p in parts if p not in chosen)
    # The best candidate is kept whenever it fits beside the mandatory spans.
    if parts:
        padded = np.concatenate([mass, np.zeros(n - len(mass))])

        def value(p: Segment) -> float:
            return float(padded[p.start : p.end].sum())

        best = max(parts, key=lambda p: (value(p), -p.start))
        if len(best) <= budget - n_mandatory:
            assert best in chosen


# ---------------------------------------------------------------- select: crafted cases


def test_highest_mass_segment_is_kept() -> None:
    mass = np.zeros(40)
    mass[25:30] = 1.0
    result = select(mass, fixed_segments(40, 10), budget=12, mandatory=[])
    assert result is not None
    assert result.kept == spans((20, 30))
    assert result.kept_tokens == 10


def test_segment_that_does_not_fit_is_skipped_for_smaller_ones() -> None:
    mass = [5.0] * 8 + [1.0, 1.0] + [0.5, 0.5] + [0.1] * 4
    segments = spans((0, 8), (8, 10), (10, 12), (12, 16))
    result = select(mass, segments, budget=4, mandatory=[])
    assert result is not None
    assert result.kept == spans((8, 12))
    assert result.kept_tokens == 4
    assert result.segments_kept == 2


def test_mandatory_spans_kept_even_with_zero_mass() -> None:
    mass = [0.0] * 5 + [1.0] * 10 + [0.0] * 5
    result = select(mass, fixed_segments(20, 5), budget=10, mandatory=spans((0, 3), (18, 20)))
    assert result is not None
    assert result.kept == spans((0, 3), (5, 10), (18, 20))
    assert result.kept_tokens == 10


def test_none_when_mandatory_exceeds_budget_counting_overlap_once() -> None:
    segments = fixed_segments(30, 5)
    mandatory = spans((0, 6), (4, 10))  # 10 distinct tokens
    assert select([1.0] * 30, segments, budget=9, mandatory=mandatory) is None
    result = select([1.0] * 30, segments, budget=10, mandatory=mandatory)
    assert result is not None
    assert result.kept == spans((0, 10))


def test_partially_covered_segment_is_trimmed() -> None:
    segments = spans((0, 10), (10, 20))
    mass = [1.0] * 20
    result = select(mass, segments, budget=10, mandatory=spans((0, 3)))
    assert result is not None
    # [3, 10) is a 7-token candidate that fits; [10, 20) does not.
    assert result.kept == spans((0, 10))
    assert result.segments_total == 3
    assert result.segments_kept == 2


def test_mandatory_inside_a_segment_splits_it_into_two_candidates() -> None:
    mass = [0.0] * 4 + [0.0] * 2 + [1.0] * 4
    result = select(mass, spans((0, 10)), budget=6, mandatory=spans((4, 6)))
    assert result is not None
    assert result.segments_total == 3
    assert result.kept == spans((4, 10))


def test_adjacent_kept_ranges_are_merged() -> None:
    mass = [1.0] * 10 + [0.0] * 10
    result = select(mass, fixed_segments(20, 5), budget=12, mandatory=spans((10, 12)))
    assert result is not None
    assert result.kept == spans((0, 12))
    assert result.token_indices() == list(range(12))


def test_ties_go_to_the_earlier_segment() -> None:
    result = select([1.0] * 20, fixed_segments(20, 5), budget=5, mandatory=[])
    assert result is not None
    assert result.kept == spans((0, 5))


def test_tokens_without_mass_score_zero() -> None:
    # Mass covers only the first 10 tokens; [15, 20) has none and must lose to [5, 10).
    mass = [0.0] * 5 + [0.1] * 5
    result = select(mass, fixed_segments(20, 5), budget=5, mandatory=[])
    assert result is not None
    assert result.kept == spans((5, 10))


def test_budget_at_least_prompt_keeps_everything() -> None:
    segments = fixed_segments(23, 5)
    for budget in (23, 100):
        result = select(np.zeros(10), segments, budget=budget, mandatory=spans((20, 23)))
        # Four candidates plus the mandatory span, which covers the last segment whole.
        assert result == Selection(kept=spans((0, 23)), kept_tokens=23, segments_total=5, segments_kept=5)


def test_list_mass_is_accepted() -> None:
    result = select([0.0, 0.0, 3.0, 0.0], fixed_segments(4, 1), budget=1, mandatory=[])
    assert result is not None
    assert result.kept == spans((2, 3))


@pytest.mark.parametrize(
    ("mass", "segments", "budget", "mandatory", "message"),
    [
        ([], [], 5, [], "empty prompt"),
        ([1.0] * 10, fixed_segments(10, 5), 0, [], "budget"),
        ([1.0] * 10, fixed_segments(10, 5), -3, [], "budget"),
        ([1.0] * 10, spans((0, 4), (5, 10)), 5, [], "contiguous"),
        ([1.0] * 10, spans((1, 5), (5, 10)), 5, [], "contiguous"),
        ([1.0] * 10, spans((0, 6), (5, 10)), 5, [], "contiguous"),
        ([1.0] * 10, spans((0, 5), (5, 5), (5, 10)), 5, [], "contiguous"),
        ([1.0] * 11, fixed_segments(10, 5), 5, [], "mass has 11"),
        ([1.0, float("nan")] + [1.0] * 8, fixed_segments(10, 5), 5, [], "NaN"),
        ([1.0, float("inf")] + [1.0] * 8, fixed_segments(10, 5), 5, [], "NaN or Inf"),
        ([1.0] * 10, fixed_segments(10, 5), 5, spans((8, 11)), "mandatory"),
        ([1.0] * 10, fixed_segments(10, 5), 5, spans((3, 3)), "mandatory"),
    ],
)
def test_invalid_inputs_raise(mass, segments, budget, mandatory, message) -> None:
    with pytest.raises(ValueError, match=message):
        select(mass, segments, budget, mandatory)


def test_token_indices() -> None:
    selection = Selection(kept=spans((0, 2), (5, 7)), kept_tokens=4, segments_total=3, segments_kept=2)
    assert selection.token_indices() == [0, 1, 5, 6]


# ---------------------------------------------------------------- segmentation


def test_segment_tokens_cuts_after_newline() -> None:
    pieces = ["a"] * 3 + ["b\n"] + ["c"] * 4
    assert segment_tokens(pieces, min_len=2, max_len=10) == spans((0, 4), (4, 8))


@pytest.mark.parametrize("end", [".", "!", "?", ";", ". ", "?  "])
def test_segment_tokens_cuts_after_sentence_end(end: str) -> None:
    pieces = ["w"] * 4 + [f"x{end}"] + ["w"] * 5
    assert segment_tokens(pieces, min_len=3, max_len=10) == spans((0, 5), (5, 10))


def test_segment_tokens_ignores_other_punctuation() -> None:
    pieces = ["a", "b,", "c:", "d", "e)", "f", "g", "h"]
    assert segment_tokens(pieces, min_len=2, max_len=10) == spans((0, 8))


def test_segment_tokens_waits_for_min_len() -> None:
    # Boundary at token 1 comes too early; the next one at token 5 closes the segment.
    pieces = ["a", "b.", "c", "d", "e", "f.", "g", "h", "i", "j"]
    assert segment_tokens(pieces, min_len=4, max_len=10) == spans((0, 6), (6, 10))


def test_segment_tokens_force_cuts_at_max_len() -> None:
    assert segment_tokens(["w"] * 25, min_len=2, max_len=10) == spans((0, 10), (10, 20), (20, 25))


def test_segment_tokens_merges_short_tail_when_it_fits() -> None:
    pieces = ["a"] * 5 + ["b."] + ["c"] * 2
    assert segment_tokens(pieces, min_len=4, max_len=10) == spans((0, 8))


def test_segment_tokens_keeps_short_tail_when_merge_would_exceed_max() -> None:
    pieces = ["a"] * 7 + ["b."] + ["c"] * 3
    assert segment_tokens(pieces, min_len=4, max_len=10) == spans((0, 8), (8, 11))


@pytest.mark.parametrize("seed", range(50))
def test_segment_tokens_tiles_prompt_within_limits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocabulary = ["the", " cat", ".", " sat", "\n", "!", "?", ";", ",", " on", "mat. ", "\n\n"]
    n = int(rng.integers(0, 400))
    pieces = [vocabulary[i] for i in rng.integers(0, len(vocabulary), size=n)]
    min_len = int(rng.integers(1, 20))
    max_len = int(rng.integers(min_len, 60))
    segments = segment_tokens(pieces, min_len=min_len, max_len=max_len)
    position = 0
    for seg in segments:
        assert seg.start == position < seg.end
        assert seg.end - seg.start <= max_len
        position = seg.end
    assert position == n
    # Only the final segment may be shorter than min_len.
    assert all(s.end - s.start >= min_len for s in segments[:-1])


def test_segment_tokens_empty_and_invalid() -> None:
    assert segment_tokens([]) == []
    with pytest.raises(ValueError, match="min_len"):
        segment_tokens(["a"], min_len=0, max_len=4)
    with pytest.raises(ValueError, match="min_len"):
        segment_tokens(["a"], min_len=5, max_len=4)


def test_fixed_segments() -> None:
    assert fixed_segments(10, 4) == spans((0, 4), (4, 8), (8, 10))
    assert fixed_segments(8, 4) == spans((0, 4), (4, 8))
    assert fixed_segments(0, 4) == []
    with pytest.raises(ValueError, match="chunk"):
        fixed_segments(10, 0)
    with pytest.raises(ValueError, match="n_tokens"):
        fixed_segments(-1, 4)


# ---------------------------------------------------------------- same output as a token-by-token reference


def runs(mask: np.ndarray) -> list[Segment]:
    """Maximal runs of True, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [Segment(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def reference_segment_tokens(pieces: list[str], min_len: int, max_len: int) -> list[Segment]:
    """The per-token loop the vectorised segmentation replaced."""
    segments, start = [], 0
    for i, piece in enumerate(pieces):
        length = i + 1 - start
        boundary = "\n" in piece or piece.rstrip().endswith((".", "!", "?", ";"))
        if length >= max_len or (length >= min_len and boundary):
            segments.append(Segment(start, i + 1))
            start = i + 1
    if start < len(pieces):
        tail = Segment(start, len(pieces))
        if len(tail) < min_len and segments and tail.end - segments[-1].start <= max_len:
            tail = Segment(segments.pop().start, tail.end)
        segments.append(tail)
    return segments


def reference_select(mass, segments, budget, mandatory) -> Selection | None:
    """The per-token selection the vectorised one replaced: same prefix sums, same greedy order."""
    n = segments[-1].end
    covered = np.zeros(n, dtype=bool)
    for span in mandatory:
        covered[span.start : span.end] = True
    if covered.sum() > budget:
        return None
    prefix = [0.0, *accumulate(float(x) for x in list(mass) + [0.0] * (n - len(mass)))]
    parts = candidate_parts(segments, covered)

    def rank(p: Segment) -> tuple[float, int]:
        return (-(prefix[p.end] - prefix[p.start]), p.start)

    remaining, chosen, kept = budget - int(covered.sum()), [], covered.copy()
    for part in sorted(parts, key=rank):
        if len(part) <= remaining:
            chosen.append(part)
            remaining -= len(part)
            kept[part.start : part.end] = True
    return Selection(runs(kept), int(kept.sum()), len(parts) + len(mandatory), len(chosen) + len(mandatory))


def tied_case(seed: int):
    """A longer prompt with few distinct mass values (many ties) and mandatory head and tail."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(200, 3000))
    choices = rng.choice(["a", " b", ".", "\n", "c!", " d"], size=n, p=[0.4, 0.4, 0.08, 0.04, 0.04, 0.04])
    pieces = [str(p) for p in choices]
    min_len = int(rng.integers(1, 24))
    segments = segment_tokens(pieces, min_len, int(rng.integers(min_len, 96)))
    mass = (rng.integers(0, 4, size=n - int(rng.integers(0, 10))) / 8).astype(np.float32)
    head, query = int(rng.integers(1, 40)), int(rng.integers(1, n // 2))
    mandatory = [Segment(0, head), Segment(n - query, n), Segment(n // 3, n // 3 + int(rng.integers(1, 50)))]
    budget = int(rng.integers(1, n))
    return segments, mandatory, mass, budget


@pytest.mark.parametrize("seed", range(200))
def test_select_matches_reference_on_random_cases(seed: int) -> None:
    _, segments, mandatory, mass, budget = random_case(seed)
    assert select(mass, segments, budget, mandatory) == reference_select(mass, segments, budget, mandatory)


@pytest.mark.parametrize("seed", range(100))
def test_select_matches_reference_with_ties_and_boundary_segments(seed: int) -> None:
    segments, mandatory, mass, budget = tied_case(seed)
    assert select(mass, segments, budget, mandatory) == reference_select(mass, segments, budget, mandatory)


@pytest.mark.parametrize("seed", range(100))
def test_segment_tokens_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    vocabulary = ["the", " cat", ".", " sat", "\n", "!", "?", ";", ",", " on", "mat. ", "\n\n", "x.)", "a;  "]
    pieces = [vocabulary[i] for i in rng.integers(0, len(vocabulary), size=int(rng.integers(0, 1500)))]
    min_len = int(rng.integers(1, 40))
    max_len = int(rng.integers(min_len, 130))
    assert segment_tokens(pieces, min_len, max_len) == reference_segment_tokens(pieces, min_len, max_len)


def test_token_boundaries_test_each_token_once_and_match_its_piece() -> None:
    # partial UTF-8 decodes to U+FFFD, as the pieces of a split character do
    vocabulary = [b"a", b" end.", b"\n", b"\xe2", b"\x80\xa6", b" x?  ", b"", b"; ", b"b,"]
    asked: list[int] = []

    def piece(token: int) -> bytes:
        asked.append(token)
        return vocabulary[token]

    boundaries = TokenBoundaries(piece)
    rng = np.random.default_rng(0)
    for size in (0, 50, 500, 3000):
        tokens = rng.integers(0, len(vocabulary) - 3 if size < 500 else len(vocabulary), size=size).tolist()
        expected = boundary_flags([vocabulary[t].decode("utf-8", errors="replace") for t in tokens])
        assert boundaries(tokens).tolist() == expected.tolist()
    assert sorted(asked) == list(range(len(vocabulary)))  # every token once, the late ones too
    with pytest.raises(ValueError, match="negative"):
        boundaries([1, -1])


def test_take_gives_the_kept_tokens_in_order() -> None:
    tokens = [100 + i for i in range(20)]
    selection = select([0.0] * 8 + [1.0] * 4, fixed_segments(20, 4), budget=10, mandatory=spans((0, 2), (18, 20)))
    assert selection is not None
    kept = [100, 101, 102, 103, 108, 109, 110, 111, 118, 119]
    assert selection.take(tokens) == [tokens[i] for i in selection.token_indices()] == kept


# ---------------------------------------------------------------- keep curve and budget


def test_keep_curve_parse_and_interpolate() -> None:
    curve = KeepCurve.parse("16000:0.5 40000:0.2 100000:0.1 139264:0.05")
    assert curve.points == ((16000, 0.5), (40000, 0.2), (100000, 0.1), (139264, 0.05))
    assert curve.ratio(16000) == pytest.approx(0.5)
    assert curve.ratio(40000) == pytest.approx(0.2)
    assert curve.ratio(28000) == pytest.approx(0.35)
    assert curve.ratio(70000) == pytest.approx(0.15)
    assert curve.ratio(1000) == pytest.approx(0.5)
    assert curve.ratio(500000) == pytest.approx(0.05)


def test_keep_curve_single_point_and_commas() -> None:
    assert KeepCurve.parse(" 1000:0.3 ").ratio(10) == pytest.approx(0.3)
    assert KeepCurve.parse("1000:0.3, 2000:0.1").ratio(1500) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "at least one"),
        ("16000", "length:ratio"),
        ("abc:0.5", "integer"),
        ("16000:half", "integer"),
        ("16000:0.5 8000:0.2", "strictly increasing"),
        ("16000:0.5 16000:0.2", "strictly increasing"),
        ("16000:0", r"\(0, 1\]"),
        ("16000:1.5", r"\(0, 1\]"),
        ("16000:-0.1", r"\(0, 1\]"),
        ("16000:nan", "finite"),
        ("0:0.5", ">= 1"),
    ],
)
def test_keep_curve_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeepCurve.parse(text)


def test_budget_for() -> None:
    assert budget_for(1000, 0.25) == 250
    assert budget_for(999, 0.5) == 499
    assert budget_for(3, 0.1) == 1
    assert budget_for(100, 1.0) == 100
    with pytest.raises(ValueError, match="keep_ratio"):
        budget_for(100, 0.0)
    with pytest.raises(ValueError, match="keep_ratio"):
        budget_for(100, 1.5)
    with pytest.raises(ValueError, match="n_tokens"):
        budget_for(-1, 0.5)
