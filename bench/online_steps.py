"""Where a decoding request's time goes beside long prompts on the CPU (issue 48, the online bench's
ITL): the demo model in an engine shaped as bench/online.py's ours (`--max_concurrency 4 --n_ctx
8192`, the CPU's step chunks), one request decoding, then long prompts arriving (RAG-sized, as the
online mix's 10%) while it decodes. Per step: its decode rows, its prefill tokens and its wall time;
per run: the decoding request's inter-token latency percentiles while the prompts prefill, their
TTFTs, and the cost of a step against its prefill tokens (least squares: ms per step + ms per token).

Each arm runs in a child process of its own tree (`--baseline REV`: a temporary worktree of that
revision beside this tree), interleaved per rep:

    python bench/online_steps.py [--baseline REV] [--reps 2] [--long 2048 4096 6144] [--gap_s 0.5]
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


def run_once(long: list[int], gap_s: float, seed: int) -> dict[str, Any]:
    """In this process's pflash_plugin: the engine, the decoding request, then the long prompts."""
    from pflash_plugin.engine import loader
    from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams, TextEvent

    config = loader.EngineConfig(max_ctx=8192, n_slots=4)
    _, engine = loader.load_engine(demo_model_path(), config)
    marks: list[tuple[float, int, int]] = []  # per step: start, decode rows, prefill tokens
    schedule = engine.scheduler.schedule

    def logged() -> Any:
        step = schedule()
        if step is not None and getattr(step, "items", None):
            lengths = [len(item.tokens) for item in step.items]
            marks.append((time.perf_counter(), sum(n == 1 for n in lengths), sum(n for n in lengths if n > 1)))
        return step

    engine.scheduler.schedule = logged  # type: ignore[method-assign]
    rng = random.Random(seed)
    token_times: list[float] = []
    ended = threading.Semaphore(0)

    def sink(event: Any, i: int) -> None:
        if i == 0 and isinstance(event, TextEvent):
            token_times.append(time.perf_counter())
        elif isinstance(event, FinishEvent):
            ended.release()

    try:
        warm = Request([rng.randrange(300, 1300) for _ in range(64)], SamplingParams(max_tokens=4), lambda e: sink(e, -1))
        engine.submit(warm)
        ended.acquire(timeout=120)
        marks.clear()
        params = SamplingParams(max_tokens=DECODE_TOKENS, min_tokens=DECODE_TOKENS, temperature=0.0)
        requests = [Request([rng.randrange(300, 1300) for _ in range(32)], params, lambda e: sink(e, 0))]
        engine.submit(requests[0])
        time.sleep(gap_s)
        start = time.perf_counter()
        for i, n in enumerate(long, 1):
            requests.append(Request([rng.randrange(300, 1300) for _ in range(n)], SamplingParams(max_tokens=2),
                                    lambda e, i=i: sink(e, i)))
            engine.submit(requests[-1])
        for _ in requests:
            assert ended.acquire(timeout=600), "a request did not finish"
        prefilled = max(r.timings.first_token or 0.0 for r in requests[1:])
    finally:
        engine.stop()
    gaps = [1000 * (b - a) for a, b in zip(token_times, token_times[1:]) if start <= a and b <= prefilled]
    steps = [(d, p, 1000 * (t1 - t0)) for (t0, d, p), (t1, _, _) in zip(marks, marks[1:]) if start <= t0 <= prefilled]
    with_decode = [s for s in steps if s[0]]
    return {"itl_ms": {"p50": round(pct(gaps, 0.5), 1), "p99": round(pct(gaps, 0.99), 1), "n": len(gaps)},
            "ttft_s": [round((r.timings.first_token or 0.0) - r.timings.arrival, 2) for r in requests[1:]],
            "prefill_s": round(prefilled - start, 2),
            "decode_steps": len(with_decode),
            "prefill_per_decode_step": round(statistics.median(p for _, p, _ in with_decode), 1) if with_decode else 0,
            "step_ms_fit": fit(with_decode)}


def child(tree: Path, long: list[int], gap_s: float, seed: int) -> dict[str, Any]:
    code = (f"import sys, json; sys.path[:0] = [{str(tree)!r}, {str(REPO / 'bench')!r}]; import online_steps; "
            f"print(json.dumps(online_steps.run_once({long!r}, {gap_s!r}, {seed!r})))")
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
    args = parser.parse_args()
    trees = {"this": REPO}
    base = worktree(args.baseline) if args.baseline else None
    if base is not None:
        trees["baseline"] = base
    try:
        for rep in range(args.reps):
            for label in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                print(json.dumps({"arm": label, "rep": rep, **child(trees[label], args.long, args.gap_s, rep)}),
                      flush=True)
    finally:
        if base is not None:
            remove_worktree(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
