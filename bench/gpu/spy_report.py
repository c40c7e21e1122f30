"""Read a py-spy chrometrace of the server (bench/gpu/concurrent_gpu.py --spy): each thread's timeline
as runs of the same stack (by function, lines left out), from the first sample where a frame matches
`--start` (default: the first request's bytes read), for `--ms` milliseconds. In `native` traces a thread
waiting for the GIL shows a condition wait (pthread_cond_timedwait) under the call it returns from.

    python bench/gpu/spy_report.py spy/mix8_42_idle.json [--ms 40] [--start data_received]

(session 68's traces: spy/ in docs/data/logs/queue_s68_d028491_h100.tar.gz)
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    """A thread's span of samples with the same stack (innermost frame last)."""

    tid: int
    start_us: int
    end_us: int
    stack: tuple[str, ...]


def runs(events: list[dict]) -> list[Run]:
    """Each thread's B/E events replayed into runs of one stack: py-spy opens (B) and closes (E) frames
    where consecutive samples differ, so a stack holds from one instant of its thread's events to the
    next that changes it (a line moving within a function does not)."""
    by_instant: dict[tuple[int, int], list[dict]] = {}
    for event in events:
        by_instant.setdefault((event["tid"], event["ts"]), []).append(event)
    stacks: dict[int, list[str]] = {}
    open_runs: dict[int, Run] = {}
    out: list[Run] = []
    for (tid, ts), group in sorted(by_instant.items(), key=lambda item: item[0][1]):
        stack = stacks.setdefault(tid, [])
        for event in sorted(group, key=lambda e: e["ph"] == "B"):  # closes before opens
            if event["ph"] == "B":
                stack.append(f"{event['name']} ({Path(event['args'].get('filename', '?')).name})")
            elif stack:
                stack.pop()
        current = open_runs.get(tid)
        if current is not None and current.stack == tuple(stack):
            continue
        if current is not None:
            current.end_us = ts
            out.append(current)
        open_runs[tid] = Run(tid, ts, ts, tuple(stack))
    return sorted(out, key=lambda r: r.start_us)


def label(stack: tuple[str, ...], depth: int) -> str:
    """The thread's name (py-spy's root frame `thread (ID): NAME`) and the innermost `depth` frames."""
    name = next((frame.partition(": ")[2].split(" (")[0][-24:] for frame in stack[:1] if frame.startswith("thread (")),
                "")
    return f"[{name}] " + " < ".join(reversed(stack[-depth:]))


def report(path: Path, start: str | float, ms: float, depth: int, min_ms: float) -> str:
    """The runs from `start` (a frame's name: its first sample; a number: ms into the trace) for `ms`."""
    all_runs = runs(json.loads(path.read_text()))
    if isinstance(start, float):
        begin: int | None = int(start * 1000)
    else:
        begin = next((r.start_us for r in all_runs if any(start in frame for frame in r.stack)), None)
    if begin is None:
        return f"{path.name}: no frame matches {start!r}"
    lines = [f"{path.name}: from {start!r} (+{begin / 1000:.1f} ms into the trace), {ms:g} ms"]
    end = begin + ms * 1000
    for run in all_runs:
        if run.end_us < begin or run.start_us > end or (run.end_us - run.start_us) / 1000 < min_ms:
            continue
        lines.append(f"{(run.start_us - begin) / 1000:8.2f} {(run.end_us - run.start_us) / 1000:7.2f} ms "
                     f"{label(run.stack, depth)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--start", default="data_received",
                        help="a frame's name (the timeline starts at its first sample) or ms into the trace")
    parser.add_argument("--ms", type=float, default=40.0)
    parser.add_argument("--depth", type=int, default=3, help="innermost frames shown per run")
    parser.add_argument("--min-ms", type=float, default=0.2, help="runs shorter than this are left out")
    args = parser.parse_args()
    for path in args.traces:
        try:
            start: str | float = float(args.start)
        except ValueError:
            start = args.start
        print(report(path, start, args.ms, args.depth, args.min_ms))


if __name__ == "__main__":
    main()
