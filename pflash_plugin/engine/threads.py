"""How many CPU threads a decode-only step runs on, chosen by measuring both candidates.

Pure: the runner asks `threads` before the step and reports the step's time to `record`.
"""
from __future__ import annotations

import statistics
from collections import deque


class DecodeThreads:
    """A step in which every slot decodes one token runs on the narrow thread count (n_threads) or
    the wide one (n_threads_batch), whichever measured faster for that many tokens. Neither wins
    everywhere: on 2 idle cores 4 slots of the demo model decoded in 36 ms on 2 threads against 64 ms
    on 1, beside one busy process in 149 ms against 67 ms (bench/decode_threads.py), because ggml's
    threads meet at every graph node and one descheduled thread stalls the others. Each count keeps
    the median of its last `window` times; every `probe_every`-th step runs the other count, so a
    change of load (a neighbour starts or stops, the PFlash drafter computes) is noticed."""

    def __init__(self, narrow: int, wide: int, probe_every: int = 64, window: int = 5) -> None:
        self.narrow, self.wide = narrow, wide
        self.probe_every, self.window = probe_every, window
        self._times: dict[tuple[int, int], deque[float]] = {}  # (threads, tokens) -> recent step seconds
        self._steps = 0

    def threads(self, tokens: int) -> int:
        """The thread count of the next decode-only step of `tokens` tokens."""
        if self.narrow == self.wide:
            return self.wide
        self._steps += 1
        wide, narrow = self._median(self.wide, tokens), self._median(self.narrow, tokens)
        if wide is None:
            return self.wide
        if narrow is None:
            return self.narrow
        best, other = (self.wide, self.narrow) if wide <= narrow else (self.narrow, self.wide)
        return other if self._steps % self.probe_every == 0 else best

    def record(self, threads: int, tokens: int, seconds: float) -> None:
        times = self._times.setdefault((threads, tokens), deque(maxlen=self.window))
        times.append(seconds)

    def _median(self, threads: int, tokens: int) -> float | None:
        times = self._times.get((threads, tokens))
        return statistics.median(times) if times else None
