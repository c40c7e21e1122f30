"""Where a decoding request's time goes beside long prompts on the CPU (issue 48, the online bench's
ITL): the demo model in an engine shaped as bench/online.py's ours (`--max_concurrency 4 --n_ctx
8192`, the CPU's step chunks), one request decoding, then long prompts arriving (RAG-sized, as the
online mix's 10%) while it decodes. Per step: its decode rows, its prefill tokens and its wall time;
per run: the decoding request's inter-token latency percentiles while the prompts prefill, their
TTFTs, and the cost of a step against its prefill tokens (least squares: ms per step + ms per token).
`--replay RATE`: bench/online.py's requests of that rate (rep by rep) at their offsets instead, in
the engine, with the same logs (its slowest steps say where a stall came from).

Each arm runs in a child process of its own tree (`--baseline REV`: a temporary worktree of that
revision beside this tree), interleaved per rep:

    python bench/online_steps.py [--baseline REV] [--chunks 64] [--reps 2] [--long 2048 4096 6144] [--gap_s 0.5]
    python bench/online_steps.py --replay 0.3 [--replay_rep 0] [--baseline REV] [--reps 3]
"""
from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))

import argparse
import json
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from harness import REPO, demo_model_path
from host_overhead import remove_worktree, worktree

DECODE_TOKENS = 400  # the decoding request's answer: long enough to outlast the prompts' prefill


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def fit(steps: list[tuple[int, int, float]]) -> tuple[float, float]:
    """ms per step and ms per prefill token over the steps with decode rows (least squares)."""
    xs = [p for _, p, _ in steps]
    ys = [ms for _, _, ms in steps]
    if len(set(xs)) < 2:
        return (statistics.mean(ys) if ys else 0.0, 0.0)
    slope, intercept = statistics.linear_regression(xs, ys)
    return round(intercept, 1), round(slope, 3)


def synthetic(long: list[int], gap_s: float, seed: int) -> list[tuple[float, list[int], int]]:
    """One request decoding DECODE_TOKENS, then `long` prompts `gap_s` later: (offset, prompt, answer)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(300, 1300) for _ in range(n)] for n in (32, *long)]
    return [(0.0 if i == 0 else gap_s, p, DECODE_TOKENS if i == 0 else 2) for i, p in enumerate(prompts)]


def replay(model: Any, rate: float, rep: int) -> list[tuple[float, list[int], int]]:
    """bench/online.py's run at `rate` and `rep`: its requests (prompts tokenized as the server does
    a completion's) at their Poisson offsets."""
    from online import WINDOW_S, CpuItems
    from online_load import arrivals

    items = CpuItems(WINDOW_S).build(rate, rep)
    offsets = arrivals(len(items), rate, 1000 * rep + int(rate * 100))
    return [(at, model.tokenize(item.prompt), item.output_tokens) for at, item in zip(offsets, items)]


def run_once(seed: int, long: list[int], gap_s: float, rate: float | None = None,
             prefill_chunk: int | None = None) -> dict[str, Any]:
    """In this process's pflash_plugin: the engine, then the requests (`synthetic`, or `replay` of
    `rate` with `seed` as its rep) at their offsets, each step's composition and time logged."""
    from pflash_plugin.engine import loader
    from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams, TextEvent

    config = loader.EngineConfig(max_ctx=8192, n_slots=4, prefill_chunk=prefill_chunk)
    model, engine = loader.load_engine(demo_model_path(), config)
    plan = synthetic(long, gap_s, seed) if rate is None else replay(model, rate, seed)
    marks: list[tuple[float, int, int]] = []  # per step: start, decode rows, prefill tokens
    schedule = engine.scheduler.schedule

    def logged() -> Any:
        step = schedule()
        if step is not None and getattr(step, "items", None):
            lengths = [len(item.tokens) for item in step.items]
            marks.append((time.perf_counter(), sum(n == 1 for n in lengths), sum(n for n in lengths if n > 1)))
        return step

    engine.scheduler.schedule = logged  # type: ignore[method-assign]
    tokens: list[list[float]] = [[] for _ in plan]
    ended = threading.Semaphore(0)

    def sink(event: Any, i: int) -> None:
        if i >= 0 and isinstance(event, TextEvent):
            tokens[i].append(time.perf_counter())
        elif isinstance(event, FinishEvent):
            ended.release()

    requests = []
    try:
        engine.submit(Request(list(range(300, 364)), SamplingParams(max_tokens=4), lambda e: sink(e, -1)))
        ended.acquire(timeout=120)
        marks.clear()
        start = time.perf_counter()
        for i, (at, prompt, n) in enumerate(plan):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            requests.append(Request(prompt, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0),
                                    lambda e, i=i: sink(e, i)))
            engine.submit(requests[-1])
        for _ in requests:
            assert ended.acquire(timeout=600), "a request did not finish"
    finally:
        engine.stop()
    return summary(plan, requests, tokens, marks)


def summary(plan: list[tuple[float, list[int], int]], requests: list[Any], tokens: list[list[float]],
            marks: list[tuple[float, int, int]]) -> dict[str, Any]:
    """TTFTs; ITL while prompts prefill (from the second arrival to the last first token) and over
    the run; requests within bench/online.py's objective; the steps' cost and the slowest steps."""
    from online import OBJECTIVE

    busy_from = requests[1].timings.arrival
    busy_to = max(r.timings.first_token or 0.0 for r in requests)
    gaps = [(b, 1000 * (b - a)) for times in tokens for a, b in zip(times, times[1:])]
    busy = [g for b, g in gaps if busy_from <= b <= busy_to]
    ttfts = [(r.timings.first_token or 0.0) - r.timings.arrival for r in requests]
    good = sum(ttft <= OBJECTIVE.ttft_s and (len(times) < 2 or (times[-1] - times[0]) / (len(times) - 1)
                                             <= OBJECTIVE.tpot_s) for ttft, times in zip(ttfts, tokens))
    steps = [(d, p, 1000 * (t1 - t0)) for (t0, d, p), (t1, _, _) in zip(marks, marks[1:])]
    with_decode = [s for s in steps if s[0]]
    return {"prompts": [len(p) for _, p, _ in plan], "ttft_s": [round(t, 2) for t in ttfts], "good": good,
            "itl_busy_ms": {"p50": round(pct(busy, 0.5), 1), "p99": round(pct(busy, 0.99), 1), "n": len(busy)},
            "itl_ms": {"p50": round(pct([g for _, g in gaps], 0.5), 1), "p99": round(pct([g for _, g in gaps], 0.99), 1)},
            "prefill_s": round(busy_to - busy_from, 2), "decode_steps_busy": len(busy),
            "step_ms_fit": fit(with_decode),
            "slowest_steps": [(round(ms), d, p) for d, p, ms in sorted(steps, key=lambda s: -s[2])[:5]]}


def child(tree: Path, seed: int, long: list[int], gap_s: float, rate: float | None, chunk: int | None) -> dict[str, Any]:
    code = (f"import sys, json; sys.path[:0] = [{str(tree)!r}, {str(REPO / 'bench')!r}]; import online_steps; "
            f"print(json.dumps(online_steps.run_once({seed!r}, {long!r}, {gap_s!r}, {rate!r}, {chunk!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision to run beside this tree")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--long", type=int, nargs="+", default=[2048, 4096, 6144])
    parser.add_argument("--gap_s", type=float, default=0.5, help="the long prompts arrive this long after the decoder")
    parser.add_argument("--replay", type=float, help="instead: bench/online.py's run at this rate, its rep each rep")
    parser.add_argument("--replay_rep", type=int, help="that run's rep in every rep (default: each rep its own)")
    parser.add_argument("--chunks", type=int, nargs="*", default=[], help="this tree also with these --prefill_chunk")
    args = parser.parse_args()
    trees: dict[str, tuple[Path, int | None]] = {"this": (REPO, None)}
    trees.update({f"this-chunk{n}": (REPO, n) for n in args.chunks})
    base = worktree(args.baseline) if args.baseline else None
    if base is not None:
        trees["baseline"] = (base, None)
    try:
        for rep in range(args.reps):
            seed = rep if args.replay_rep is None else args.replay_rep
            for label in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                row = child(trees[label][0], seed, args.long, args.gap_s, args.replay, trees[label][1])
                print(json.dumps({"arm": label, "rep": rep, **row}), flush=True)
    finally:
        if base is not None:
            remove_worktree(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
