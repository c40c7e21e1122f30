"""llguidance's mask fill alone, by executor threads: R rows of the bench's person schema (each its
own matcher, or deep copies of one: `--copies`, whose masks share a lexer and its lock) walked to the
end of their JSON by random allowed tokens, every row's mask filled each step in one executor call,
as the engine's fill thread does (engine/constraint_masks.py). Prints ms a step and per row filled.

Why (issue 49): on the H200 the engine's fill of ~52 rows a step took 6.3-7.0 ms on 8 threads, ~0.12
ms a row, where this CPU fills a row in ~0.04 ms on one thread: does the fill scale with threads
there, and what does a row cost without the server around it?

    PYTHONPATH=.:bench python bench/fill_scale.py --model TINY128K.gguf --threads 1 2 --reps 3
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from constrained import PERSON  # noqa: E402
from harness import machine  # noqa: E402

from pflash_plugin.engine.constraint_masks import _allowed_ids  # noqa: E402
from pflash_plugin.engine.constraints import _matcher, compile_schema  # noqa: E402
from pflash_plugin.llama import Model  # noqa: E402


def walk(model: Model, executor: llguidance.LLExecutor, rows: int, copies: bool, seed: int) -> dict[str, float]:
    """One run: every live row's mask filled each step, then a random allowed token each."""
    grammar = compile_schema(PERSON)
    template = _matcher(model, grammar) if copies else None
    matchers = [template.deep_copy() if template is not None else _matcher(model, grammar) for _ in range(rows)]
    words = (model.n_vocab + 31) // 32
    masks = np.zeros((rows, words), dtype=np.int32)
    rng, live, seconds, filled, steps = random.Random(seed), list(range(rows)), 0.0, 0, 0
    while live and steps < 200:
        start = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(matchers[i], i) for i in live], masks.ctypes.data, words * 4, rows)
        seconds += time.perf_counter() - start
        filled, steps = filled + len(live), steps + 1
        going = []
        for i in live:
            allowed = _allowed_ids(masks[i], model.n_vocab)
            if allowed.size and matchers[i].consume_token(int(rng.choice(allowed.tolist()))) \
                    and not matchers[i].is_stopped():
                going.append(i)
        live = going
    return {"steps": steps, "ms_per_step": 1000 * seconds / steps, "us_per_row": 1e6 * seconds / filled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", "--target", dest="model", required=True)
    parser.add_argument("--drafter", help="(servers.sh passes it; not used)")
    parser.add_argument("--llama-server", dest="llama_server", help="(servers.sh passes it; not used)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--copies", action="store_true", help="deep copies of one matcher (a shared lexer)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = Model(args.model, vocab_only=True)  # the tokenizer alone: no weights read
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):  # threads interleaved within each rep, the same walks for each
        for threads in args.threads:
            run = walk(model, llguidance.LLExecutor(num_threads=threads), args.rows, args.copies, seed=rep)
            rows.append({"rep": rep, "threads": threads, **run})
            print(json.dumps(rows[-1]), flush=True)
    medians = {threads: {key: round(statistics.median(r[key] for r in rows if r["threads"] == threads), 2)
                         for key in ("ms_per_step", "us_per_row")} for threads in args.threads}
    print("| threads | ms a step | us a row |\n|---:|---:|---:|")
    for threads, m in medians.items():
        print(f"| {threads} | {m['ms_per_step']} | {m['us_per_row']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "n_vocab": model.n_vocab,
                                        "copies": args.copies, "medians": medians, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
