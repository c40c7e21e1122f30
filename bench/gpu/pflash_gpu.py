"""PFlash on a GPU: time to first token of full prefill against PFlash, per prompt length and
drafter kind, with the scoring time split and the bound 1/(r + c); then decode throughput of 4
slots while a long prompt is in compression.

On the CUDA machine (see bench/gpu/run.sh, which builds, writes the models and runs this):
    python bench/gpu/pflash_gpu.py --target T.gguf --drafter D.gguf --out results.json
Models are random-weight GGUFs of real shapes (pflash_plugin.testing.write_tiny_llama, tiled).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pflash_plugin.server.runtime.models import ServedModel
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.server.runtime.inprocess import Run

import numpy as np  # after llama_cpp: numpy first made the CUDA model load segfault on the H200 machine

KEEP = 0.1


def prompt(served: ServedModel, n: int, seed: int) -> list[int]:
    """n tokens of random words of the model's vocabulary (timing does not depend on content)."""
    words = [t for t in range(served.model.n_vocab) if served.model.piece(t).strip().isalpha()]
    rng = np.random.default_rng(seed)
    return [served.model.bos] + [int(t) for t in rng.choice(words, n - 1)]


def serve(target: str, n_ctx: int, slots: int, **pflash) -> ServedModel:
    return ServedModel(ModelSettings(
        model=target, n_gpu_layers=-1, n_ctx=n_ctx, max_concurrency=slots, n_batch=2048, n_ubatch=512,
        flash_attn=True, pflash="always", pflash_keep_ratio=KEEP, verbose=bool(os.environ.get("BENCH_VERBOSE")),
        **pflash))


def ttft_rows(served: ServedModel, arm: str, lengths: list[int], reps: int) -> list[dict]:
    Run(served, prompt(served, 2048, 0), "always").wait()  # warm up both paths
    Run(served, prompt(served, 2048, 0), "off").wait()
    rows = []
    for n in lengths:
        for rep in range(reps if n <= 65536 else 1):
            # different random prompts of one length: the prefix cache must not serve the second arm
            full = Run(served, prompt(served, n, 2 * (n + rep)), "off").wait()
            fast = Run(served, prompt(served, n, 2 * (n + rep) + 1), "always").wait()
            report = fast.usage["timings"]["pflash"]
            rows.append({"arm": arm, "tokens": n, "rep": rep, "full_s": round(full.ttft_s, 3),
                         "pflash_s": round(fast.ttft_s, 3), "report": report})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_under_compression(served: ServedModel, long_tokens: int, decoders: int = 4) -> dict:
    """Tokens/s of `decoders` streams before and while a long prompt is in compression."""
    runs = [Run(served, prompt(served, 64, 100 + i), "off", max_tokens=4000) for i in range(decoders)]
    for run in runs:
        run.first.wait(60)

    def generated() -> tuple[float, int]:  # the engine's own count, not event arrival times
        return time.perf_counter(), sum(len(run.request.output_tokens) for run in runs)

    time.sleep(1.0)
    before_start = generated()
    time.sleep(2.0)
    before_end = generated()
    long = Run(served, prompt(served, long_tokens, 7), "always")
    while not served.engine.stats().compressing and not long.first.is_set():
        time.sleep(0.001)
    during_start = generated()
    while served.engine.stats().compressing:
        time.sleep(0.001)
    during_end = generated()
    long.wait()
    for run in runs:
        served.engine.cancel(run.request)

    def rate(a: tuple[float, int], b: tuple[float, int]) -> float:
        return (b[1] - a[1]) / (b[0] - a[0])

    result = {"decoders": decoders, "long_tokens": long_tokens, "before_tok_s": round(rate(before_start, before_end), 1),
              "during_tok_s": round(rate(during_start, during_end), 1),
              "compression_s": round(during_end[0] - during_start[0], 3),
              "report": long.usage["timings"]["pflash"]}
    result["ratio"] = round(result["during_tok_s"] / result["before_tok_s"], 3)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["drafter", "drafter-causal", "self-default", "self-default-causal"])
    parser.add_argument("--concurrency", type=int, default=65536, help="long prompt for the decode test (0: skip)")
    parser.add_argument("--duties", type=float, nargs="+", default=[1.0, 0.5], help="pflash_shared_duty values")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    n_ctx = max(args.lengths) + 1024
    causal = {"pflash_drafter_window": 0}  # the windowed arms use the default (windows above 16K tokens)
    arms = {"self-default": {}, "self-L1": {"pflash_layers": [1]}, "drafter": {"pflash_drafter": args.drafter},
            "self-default-causal": causal, "self-L1-causal": {"pflash_layers": [1], **causal},
            "drafter-causal": {"pflash_drafter": args.drafter, **causal}}
    results: dict = {"ttft": [], "decode": None}
    for arm in args.arms:
        t0 = time.perf_counter()
        served = serve(args.target, n_ctx, 1, **arms[arm])
        print(f"{arm}: loaded in {time.perf_counter() - t0:.1f} s, scorer {served.pflash_scorer}", flush=True)
        results["ttft"] += ttft_rows(served, arm, args.lengths, args.reps)
        served.close()
        args.out.write_text(json.dumps(results, indent=1))
    if args.concurrency:
        results["decode"] = []
        for duty in args.duties:
            served = serve(args.target, args.concurrency + 1024, 5, pflash_drafter=args.drafter, pflash_shared_duty=duty)
            results["decode"].append({"shared_duty": duty, **decode_under_compression(served, args.concurrency)})
            served.close()
    args.out.write_text(json.dumps(results, indent=1))
    for arm in args.arms:
        for n in args.lengths:
            rows = [r for r in results["ttft"] if r["arm"] == arm and r["tokens"] == n]
            if rows:
                full = statistics.median(r["full_s"] for r in rows)
                fast = statistics.median(r["pflash_s"] for r in rows)
                print(f"{arm:>13} {n:>7}: full {full:.3f} s  pflash {fast:.3f} s  {full / fast:.2f}x")


if __name__ == "__main__":
    main()
