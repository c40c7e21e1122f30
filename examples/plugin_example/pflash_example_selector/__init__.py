"""A PFlash segment selector that ignores the attention scores: it keeps the mandatory spans (the
prompt's head, the query and what follows it) and then the most recent segments that fit the
budget, the way a sliding-window cache would. A baseline to compare the scored selection with."""
from __future__ import annotations

from typing import Sequence

from pflash_plugin.pflash.selection import Segment, Selection

# every selection made, as kept (start, end) spans: read by the example route
SELECTIONS: list[list[tuple[int, int]]] = []


def _spans(indices: set[int]) -> list[Segment]:
    spans: list[Segment] = []
    for i in sorted(indices):
        if spans and spans[-1].end == i:
            spans[-1] = Segment(spans[-1].start, i + 1)
        else:
            spans.append(Segment(i, i + 1))
    return spans


def select_recent(mass: Sequence[float], segments: list[Segment], budget: int,
                  mandatory: list[Segment]) -> Selection | None:
    """Same contract as pflash_plugin.pflash.selection.select; None: the mandatory spans alone exceed the budget."""
    keep = {i for span in mandatory for i in range(span.start, span.end)}
    if len(keep) > budget:
        return None
    chosen = 0
    for segment in reversed(segments):
        new = [i for i in range(segment.start, segment.end) if i not in keep]
        if new and len(keep) + len(new) <= budget:
            keep.update(new)
            chosen += 1
    kept = _spans(keep)
    SELECTIONS.append([(s.start, s.end) for s in kept])
    return Selection(kept=kept, kept_tokens=len(keep), segments_total=len(segments),
                     segments_kept=chosen + len(mandatory))
