"""Greedy outputs of 8 prompts on the demo model, alone and 4 at a time, with a KV stream per slot and
with one unified pool: where batching changes the tokens, and whether the layout does.

Usage: python bench/layout_outputs.py   (prints the common greedy prefix, of 32 tokens, per prompt)
"""
from __future__ import annotations

import threading

from harness import demo_model_path

from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.prefix_cache import common_prefix
from pflash_plugin.engine.request import ErrorEvent, FinishEvent, Request, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "In 1969, the first humans", "import numpy as np\n",
           "The recipe calls for two cups of", "Dear hiring manager, I am writing"]
GREEDY = SamplingParams(max_tokens=32, temperature=0, min_tokens=32)


def run_together(engine, requests: list[Request]) -> list[list[int]]:
    done = threading.Semaphore(0)
    for request in requests:
        request.sink = lambda event: done.release() if isinstance(event, (FinishEvent, ErrorEvent)) else None
    engine.submit(*requests)
    for _ in requests:
        assert done.acquire(timeout=600), "a request did not finish"
    return [r.output_tokens for r in requests]


def outputs(layout: str) -> tuple[list[list[int]], list[list[int]]]:
    """(each prompt alone, the prompts 4 at a time) on a fresh cache each run."""
    model, engine = load_engine(demo_model_path(), EngineConfig(n_slots=4, max_ctx=512, kv_layout=layout,
                                                                n_threads=1, n_threads_batch=2))
    try:
        alone, together = [], []
        for prompt in PROMPTS:
            engine.clear_prefix_cache()
            alone += run_together(engine, [Request(model.tokenize(prompt), GREEDY)])
        for i in range(0, len(PROMPTS), 4):
            engine.clear_prefix_cache()
            together += run_together(engine, [Request(model.tokenize(p), GREEDY) for p in PROMPTS[i:i + 4]])
        return alone, together
    finally:
        engine.stop()


def main() -> None:
    runs = {layout: outputs(layout) for layout in ("per_slot", "unified")}
    for layout, (alone, together) in runs.items():
        print(f"{layout}: together vs alone, common prefix per prompt:",
              [common_prefix(a, t) for a, t in zip(alone, together)])
    print("alone, per_slot == unified:", [a == b for a, b in zip(runs["per_slot"][0], runs["unified"][0])])
    print("together, per_slot vs unified common prefix:",
          [common_prefix(a, b) for a, b in zip(runs["per_slot"][1], runs["unified"][1])])


if __name__ == "__main__":
    main()
