"""Where a request's slot is, with a KV stream per slot: adjacent to the running ones, or wherever
the least recently used cache was. llama.cpp splits a batch into one ubatch per run of consecutive
sequences there (`split_equal(sequential)`), and each ubatch reads all the weights again.

Per rep and arm, on a fresh engine (64 slots, `--kv_layout per_slot`): 64 warm-up requests of
random lengths leave every slot a cache in a random order of use; then `--requests` requests
decode together. Two scenarios, each with its two arms interleaved:
- `new`: new prompts. `adjacent` (SlotPlacement's rule) against `lru` (the same rule without its
  neighbour term: what it was before).
- `chats`: each request is the next turn of a warm-up's conversation, whose cache is in its slot.
  `moved` (a lone slot's prefix copied beside the running ones) against `in_place` (reused where it is).
Printed: the slots taken, their runs of consecutive slots (ubatches per decode step), ms per step,
tok/s; medians over reps.

    python bench/slot_placement.py [--scenario new|chats] [--model demo|tiny|PATH] [--requests 8] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from harness import demo_model_path, machine, run_to_end
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.slot_placement import SlotPlacement
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.llama import ModelParams
from pflash_plugin.testing import cached_tiny_llama

SLOTS = 64


def runs(slots: list[int]) -> int:
    """Runs of consecutive slot numbers: the ubatches a step of these slots takes."""
    ordered = sorted(slots)
    return 1 + sum(1 for a, b in zip(ordered, ordered[1:]) if b != a + 1)


# per scenario: its two arms, the first SlotPlacement's rule, the second what it was before
ARMS = {"new": ("adjacent", "lru"), "chats": ("moved", "in_place")}
WITHOUT = {"lru": ("beside_running", lambda self, slot: 0),  # no neighbour term
           "in_place": ("lone_runs_move", lambda self, idle, copying: False)}


def one(path: str, arm: str, args: argparse.Namespace, seed: int) -> dict:
    name, replacement = WITHOUT.get(arm, (None, None))
    rule = getattr(SlotPlacement, name) if name else None
    if name:
        setattr(SlotPlacement, name, replacement)
    model, engine = load_engine(path, EngineConfig(n_slots=SLOTS, max_ctx=256, kv_layout="per_slot",
                                                   backend_sampling="off", model=ModelParams(n_gpu_layers=0)))
    try:
        rng = random.Random(seed)
        prompt = lambda: [rng.randrange(10, 1000) for _ in range(16)]  # noqa: E731
        warm = [Request(prompt(), SamplingParams(max_tokens=rng.randint(1, 24), temperature=0)) for _ in range(SLOTS)]
        run_to_end(engine, warm, 600)
        chats = rng.sample(warm, args.requests)
        prompts = ([w.prompt_tokens + w.output_tokens + prompt()[:4] for w in chats] if args.scenario == "chats"
                   else [prompt() for _ in range(args.requests)])
        requests = [Request(p, SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=0))
                    for p in prompts]
        steps = engine.steps
        wall = run_to_end(engine, requests, 600)
        steps = engine.steps - steps
        slots = [r.slot for r in requests]
    finally:
        engine.stop()
        engine.close()
        model.close()
        if name:
            setattr(SlotPlacement, name, rule)
    return {"arm": arm, "slots": slots, "runs": runs(slots), "cached": sum(r.cached_tokens for r in requests),
            "ms_per_step": round(1000 * wall / steps, 2), "tok_s": round(args.requests * args.tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=list(ARMS), default="new")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "slot_placement.json")
    args = parser.parse_args()
    path = {"demo": demo_model_path, "tiny": lambda: str(cached_tiny_llama())}.get(args.model, lambda: args.model)()
    rows = []
    for rep in range(args.reps):
        for arm in ARMS[args.scenario][:: 1 if rep % 2 == 0 else -1]:  # each first in turn
            rows.append({**one(path, arm, args, seed=rep), "rep": rep})
            print(json.dumps(rows[-1]), flush=True)
    summary = {arm: {key: statistics.median(r[key] for r in rows if r["arm"] == arm)
                     for key in ("runs", "cached", "ms_per_step", "tok_s")} for arm in ARMS[args.scenario]}
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "model": path, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
